"""The default tracker logs from a worker process: the step never imports mlflow, and nothing is lost
when the step fails, dies or the store refuses the run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctrflow.errors import UserError
from ctrflow.tracking import make_tracker, server
from ctrflow.tracking.background import BackgroundTracker

pytestmark = pytest.mark.integration
mlflow = pytest.importorskip("mlflow")

STEP = """
import json, os, sys
from pathlib import Path
from ctrflow.tracking import make_tracker

uri, mode = sys.argv[1], sys.argv[2]
tracker = make_tracker(uri, "bg", "step", tags={"ctrflow.step": "train"})
tracker.log_params({"lr": 0.01, "model": "dlrm"})
tracker.log_metrics({"loss": 0.7}, step=1)
tracker.log_metrics({"loss": 0.6, "auc": 0.71}, step=2)
report = Path("report.json")
report.write_text("{}")
tracker.log_artifact(report)
report.unlink()  # logged before log_artifact returned
print(json.dumps({"run_id": tracker.run_id, "step_imported_mlflow": "mlflow" in sys.modules}), flush=True)
if mode == "die":
    os._exit(3)  # no close, no atexit: the worker sees its input end
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


def test_failed_step_logs_everything_and_never_imports_mlflow(store, tmp_path):
    step = run_step(store, "fail", tmp_path)
    assert step["step_imported_mlflow"] is False
    client = mlflow.MlflowClient(store)
    run = client.get_run(step["run_id"])
    assert run.info.status == "FAILED"  # ended before the step's process returned
    assert_logged(run, client)


def test_step_that_dies_leaves_a_failed_run_with_what_it_sent(store, tmp_path):
    step = run_step(store, "die", tmp_path)
    client = mlflow.MlflowClient(store)
    deadline = time.monotonic() + 120
    while client.get_run(step["run_id"]).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)  # the worker outlives the step's process by the time it takes to end the run
    run = client.get_run(step["run_id"])
    assert run.info.status == "FAILED"
    assert_logged(run, client)


def test_a_store_that_cannot_open_is_one_user_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    uri = f"sqlite:///{tmp_path}/file/mlflow.db"
    tracker = make_tracker(uri, "bg", "step")
    assert isinstance(tracker, BackgroundTracker)
    with pytest.raises(UserError, match="MLflow tracking .*file/mlflow.db"):
        with tracker:
            tracker.log_params({"a": 1})
    tracker.close()  # reported once; closing again does nothing


def test_a_step_starts_its_worker_when_parsed_and_its_tracker_takes_it_over(store, tmp_path, monkeypatch):
    from ctrflow.cli import build_parser
    from ctrflow.tracking import background

    monkeypatch.setattr(background, "_prepared", {})
    server.wait_connected(server.socket_path(), None).close()  # a server runs (a step finding none starts one)
    raw = tmp_path / "day.tsv"
    raw.write_text("")
    count = ["preprocess", "--tracking-uri", store, "count", "--input", str(raw), "--out", str(tmp_path / "c")]
    background.prepare_from_args(build_parser(count).parse_args(count))  # a fan-out action logs no run
    off = ["preprocess", "--train", str(raw), "--out", str(tmp_path / "o"), "--tracking-uri", "none"]
    background.prepare_from_args(build_parser(off).parse_args(off))
    assert background._prepared == {}

    step = ["preprocess", "--train", str(raw), "--out", str(tmp_path / "o"), "--tracking-uri", store]
    background.prepare_from_args(build_parser(step).parse_args(step))
    worker = background._prepared[store]
    with make_tracker(store, "bg", "preprocess") as tracker:
        assert tracker._conn is worker and background._prepared == {}
        tracker.log_params({"rows": 3})
    assert mlflow.MlflowClient(store).get_run(tracker.run_id).data.params == {"rows": "3"}
