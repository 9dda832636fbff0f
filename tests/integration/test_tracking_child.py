"""A step command's run is logged by a child process of the command: the run spans the step's real
start and end, the step never imports mlflow, nothing of it outlives the command, and nothing is
lost when the step fails, dies or the store refuses the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctrflow.processes import process_alive

pytestmark = pytest.mark.integration
mlflow = pytest.importorskip("mlflow")

STEP = """
import argparse, json, os, sys, time
from pathlib import Path
from ctrflow.tracking import make_tracker
from ctrflow.tracking.child import prepare_from_args

uri, mode = sys.argv[1], sys.argv[2]
prepare_from_args(argparse.Namespace(tracking_uri=uri, experiment="child"))  # as `ctrflow STEP` does
tracker = make_tracker(uri, "child", "step", tags={"ctrflow.step": "train"})
tracker.log_params({"lr": 0.01, "model": "dlrm"})
tracker.log_metrics({"loss": 0.7}, step=1)
tracker.log_metrics({"loss": 0.6, "auc": 0.71}, step=2)
report = Path("report.json")
report.write_text("{}")
tracker.log_artifact(report)
report.unlink()  # logged before log_artifact returned
print(json.dumps({"run_id": tracker.run_id, "child": tracker._child.pid,
                  "step_imported_mlflow": "mlflow" in sys.modules}), flush=True)
if mode == "die":
    os._exit(3)  # no close, no atexit: the child sees its input end
with tracker:
    raise SystemExit("diverged")
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def run_step(store: str, mode: str, cwd: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", STEP, store, mode], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode in (1, 3), done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def assert_logged(run, client) -> None:
    assert run.data.params == {"lr": "0.01", "model": "dlrm"}
    assert run.data.tags["ctrflow.step"] == "train"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [0.7, 0.6]
    assert run.data.metrics["auc"] == 0.71
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["report.json"]


def tracking_children(store: str) -> list[int]:
    """Pids of the tracking children logging into `store` that still run."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if store.encode() in words and any(b"ctrflow.tracking.child" in w for w in words):
            found.append(int(cmdline.parent.name))
    return [pid for pid in found if process_alive(pid)]


def test_a_step_command_logs_its_run_from_its_start_to_its_end_and_leaves_no_process(store, tmp_path):
    began = time.time() * 1000
    done = subprocess.run([sys.executable, "-m", "ctrflow", "synth", "--rows", "300", "--days", "1", "--out",
                           str(tmp_path / "raw"), "--tracking-uri", store, "--experiment", "cli"],
                          capture_output=True, text=True, timeout=600)
    ended = time.time() * 1000
    assert done.returncode == 0, done.stderr
    assert tracking_children(store) == []
    client = mlflow.MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    written = (tmp_path / "raw" / "synth.json").stat().st_mtime * 1000
    # the run spans the step's work (it began before the rows were written), not only its logging
    assert began <= run.info.start_time < written <= run.info.end_time <= ended
    assert run.info.status == "FINISHED" and run.data.params["rows"] == "300"


def test_failed_step_logs_everything_and_never_imports_mlflow(store, tmp_path):
    step = run_step(store, "fail", tmp_path)
    assert step["step_imported_mlflow"] is False
    assert not process_alive(step["child"])  # the command waited for its child
    client = mlflow.MlflowClient(store)
    run = client.get_run(step["run_id"])
    assert run.info.status == "FAILED"
    assert_logged(run, client)


def test_step_that_dies_leaves_a_failed_run_with_what_it_sent(store, tmp_path):
    step = run_step(store, "die", tmp_path)
    client = mlflow.MlflowClient(store)
    deadline = time.monotonic() + 120
    while process_alive(step["child"]) and time.monotonic() < deadline:
        time.sleep(0.2)  # the child outlives the step's process by the time it takes to end the run
    assert not process_alive(step["child"])
    run = client.get_run(step["run_id"])
    assert run.info.status == "FAILED"
    assert_logged(run, client)


def test_a_store_that_cannot_open_is_one_step_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    uri = f"sqlite:///{tmp_path}/file/mlflow.db"
    done = subprocess.run([sys.executable, "-m", "ctrflow", "synth", "--rows", "100", "--days", "1", "--out",
                           str(tmp_path / "raw"), "--tracking-uri", uri], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MLFLOW_LOGGING_LEVEL": "CRITICAL"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"ctrflow synth: error: MLflow tracking ({uri}): ")



def unused_url() -> str:
    """An http URL of a local port nothing listens on."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def without_proxies() -> dict:
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


def test_a_tracking_server_that_does_not_answer_fails_the_step_at_once(tmp_path):
    uri, started = unused_url(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ctrflow", "synth", "--rows", "100", "--days", "1", "--out",
                           str(tmp_path / "raw"), "--tracking-uri", uri], capture_output=True, text=True,
                          timeout=600, env=without_proxies())
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"ctrflow synth: error: MLflow tracking server {uri} does not answer (Connection refused): start it, "
        "or pass --tracking-uri none to run without tracking"]
    assert time.monotonic() - started < 60  # MLflow's own retries would take minutes
    assert not (tmp_path / "raw").exists()  # refused before the step's work


def test_a_pipeline_run_against_a_server_that_does_not_answer_is_refused_in_one_line(monkeypatch):
    from ctrflow.errors import UserError
    from ctrflow.tracking import start_pipeline_run

    for key in set(os.environ) - set(without_proxies()):
        monkeypatch.delenv(key)
    with pytest.raises(UserError, match="does not answer"):
        start_pipeline_run(unused_url(), "exp", "pipeline", "kfp-1", {})
