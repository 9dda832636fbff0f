"""Session fixtures shared by the integration tests: a real `mlflow server` on 127.0.0.1, one local
run of the whole KFP pipeline tracked in it, and the serving venv with a real tritonserver."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = "ctrflow-integration"
MODEL_NAME = "ctr_integration"


@pytest.fixture(scope="session")
def serving_venv() -> Path:
    """The serving venv, or a skip saying how to make it (a failure in CI, where `make test` makes it)."""
    from ctrflow.serve.tritonserver import find_serving_venv

    venv = find_serving_venv()
    if venv is None:
        reason = "serving venv absent: run scripts/setup_triton.sh (or set CTRFLOW_TRITON_VENV)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return venv


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_health(url: str, server: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {server.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server not healthy in {timeout:.0f} s:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """The URL of a real MLflow tracking + registry server (SQLite and artifacts in a temp dir)."""
    pytest.importorskip("mlflow")
    tmp = tmp_path_factory.mktemp("mlflow_server")
    url = f"http://127.0.0.1:{_free_port()}"
    log = tmp / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db",
             "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1",
             "--port", url.rsplit(":", 1)[1], "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            # no job runner: it forks ~8 consumer processes for features ctrflow does not use
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        _wait_for_health(url, server, log)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the server's own session: it and its workers
            server.wait(10)


@pytest.fixture(scope="session")
def pipeline_run(mlflow_server, tmp_path_factory) -> dict:
    """One local run of the whole pipeline on tiny synthetic data, tracked in `mlflow_server`;
    returns `summarize_local_run`'s headline plus the server URL."""
    pytest.importorskip("kfp")
    from ctrflow_pipelines.local import run_local, summarize_local_run

    root = tmp_path_factory.mktemp("pipeline_root")
    arguments = {"synth_rows": 4000, "synth_days": 2, "seed": 3, "freq_threshold": 2, "batch_size": 64,
                 "embedding_dim": 8, "model_name": MODEL_NAME, "mlflow_tracking_uri": mlflow_server,
                 "mlflow_experiment": EXPERIMENT}
    cwd = os.getcwd()
    os.chdir(REPO)  # the tasks are subprocesses that import the repository's packages
    try:
        run_dir = run_local(root, arguments)
    finally:
        os.chdir(cwd)
    return {**summarize_local_run(run_dir), "url": mlflow_server, "experiment": EXPERIMENT,
            "model_name": MODEL_NAME}
