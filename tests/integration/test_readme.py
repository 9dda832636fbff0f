"""A new user's first hour, as the README tells it: `make demo`'s command in a fresh folder whose
`.venv` is this environment, its printed headline and `mlflow ui` command, then the README's step
block pasted into bash as written.

One substitution keeps it short: the step block's `--rows 200000` becomes `--rows $CTRFLOW_README_ROWS`
(default 20000, where every model already ranks above chance: test_train_quality.py holds the quality
bar; the test checks the README holds that text exactly once), and the demo gets `--rows 5000`.
Everything else runs verbatim, with `.venv/bin` not on PATH until the block's own `source
.venv/bin/activate`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
README_ROWS = "--rows 200000"
ROWS = int(os.environ.get("CTRFLOW_README_ROWS", "20000"))
DEMO_ROWS = 5000
LABEL = re.compile(r"^([A-Za-z_0-9 ]+): +(\S.*)$")


def readme_steps() -> str:
    """The bash block of the README's "The steps" section."""
    section = (REPO / "README.md").read_text().split("\n## The steps\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def demo_command() -> list[str]:
    """`make demo`'s command, from the Makefile (with $(BIN) = .venv/bin)."""
    recipe = (REPO / "Makefile").read_text().split("\ndemo:", 1)[1].splitlines()[1].strip()
    assert recipe == "$(BIN)/ctrflow demo --out runs/demo", recipe
    return shlex.split(recipe.replace("$(BIN)", ".venv/bin"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> dict:
    """A folder standing for a fresh clone after the README's setup: `.venv` is this environment
    (where `make setup` installed ctrflow), no tracking URI set, `.venv/bin` not on PATH."""
    if not (Path(sys.prefix) / "bin" / "activate").exists():
        pytest.skip("the tests do not run in a virtual environment (make setup's .venv)")
    root = tmp_path_factory.mktemp("clone")
    (root / ".venv").symlink_to(sys.prefix)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "VIRTUAL_ENV"))}
    bin_dir = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != bin_dir)
    return {"root": root, "env": env}


@pytest.fixture(scope="module")
def demo(clone) -> str:
    """What `make demo`'s command prints (stdout)."""
    done = subprocess.run([*demo_command(), "--rows", str(DEMO_ROWS)], cwd=clone["root"], env=clone["env"],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def headline(printed: str) -> dict[str, str]:
    """The demo's closing block: {label: value}."""
    block = printed.rsplit("\n\n", 1)[1].strip("\n").splitlines()
    return dict(LABEL.match(line).groups() for line in block)


def test_demo_headline_is_aligned(demo):
    block = demo.rsplit("\n\n", 1)[1].strip("\n").splitlines()
    assert block[0].startswith("model AUC on day_1:") and block[-1].startswith("wall time:")
    assert all(LABEL.match(line) for line in block), block  # no line indented by KFP's runner
    columns = {LABEL.match(line).start(2) for line in block}
    assert len(columns) == 1, block  # every value starts in the same column


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, data: dict | None = None) -> dict:
    request = urllib.request.Request(url, data=None if data is None else json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def test_the_printed_mlflow_ui_command_serves_the_demo_run_without_telemetry(demo, clone):
    lines = headline(demo)
    command, link = lines["open the MLflow UI"], lines["then the pipeline run"]
    assert command.startswith("MLFLOW_DISABLE_TELEMETRY=true .venv/bin/mlflow ui --workers 1 --backend-store-uri "
                              "sqlite:///")
    assert link.startswith("http://127.0.0.1:5000/#/experiments/") and link.endswith("?workflowType=machine_learning")
    assert lines["all runs"].endswith("/runs?viewStateShareKey=ctrflow-runs&workflowType=machine_learning")
    run_id = link.split("/runs/")[1].split("?")[0]
    port = _free_port()
    server = subprocess.Popen(["bash", "-c", f"exec env {command} --port {port}"], cwd=clone["root"],
                              env=clone["env"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, "the printed mlflow ui command exited"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "mlflow ui did not come up"
                time.sleep(1)
        run = _get(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        assert metrics["auc"] == pytest.approx(float(lines["model AUC on day_1"]), abs=5e-5)
        assert _get(f"{base}/ajax-api/3.0/mlflow/ui-telemetry")["disable_ui_telemetry"] is True
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def test_readme_steps_run_as_written_after_the_demo(demo, clone):
    steps = readme_steps()
    assert steps.count(README_ROWS) == 1, "the README's synth line changed: update this test's substitution"
    lines = [line for line in steps.replace(README_ROWS, f"--rows {ROWS}").splitlines() if line.strip()]
    assert lines[0].split("#")[0].strip() == "source .venv/bin/activate"
    assert [line.split()[1] for line in lines[1:]] == ["synth", "preprocess", "train", "evaluate", "export",
                                                         "predict", "promote"]
    # one bash, as a user pastes it; each command's start time is noted for the README's figures
    script = "set -e\n" + "\n".join(f"echo \"@@ {i} $(date +%s.%N)\" >&2\n{line}" for i, line in enumerate(lines))
    done = subprocess.run(["bash", "-c", script + "\necho \"@@ end $(date +%s.%N)\" >&2"], cwd=clone["root"],
                          env=clone["env"], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    marks = [float(m) for m in re.findall(r"^@@ \S+ (\S+)$", done.stderr, re.M)]
    seconds = {line.split()[1] if i else "activate": round(b - a, 1)
               for i, (line, a, b) in enumerate(zip(lines, marks, marks[1:]))}
    print(f"README steps at {ROWS} rows a day, seconds: {seconds}")

    root = clone["root"]
    assert json.loads((root / "eval" / "metrics.json").read_text())["auc"] > 0.5
    assert len((root / "scores.csv").read_text().splitlines()) == ROWS + 1
    assert (root / "repo" / "ctr" / "config.pbtxt").exists() and (root / "mlflow.db").exists()
    assert re.search(r"^promoted ctr version 1 to champion", done.stdout, re.M), done.stdout
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
