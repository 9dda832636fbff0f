"""The pipeline definition: committed IR is current, GPU requests only on the GPU branch, the CLI
maps flags to parameters, and `submit` sends the KFP v2beta1 API what a real server expects."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from ctrflow.cli import build_parser
from ctrflow.errors import UserError

pytest.importorskip("kfp")

from pipelines.cli import parameter_values  # noqa: E402
from pipelines.compile import COMMITTED, compile_pipeline  # noqa: E402
from pipelines.submit import submit_kfp, submit_vertex  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return compile_pipeline(tmp_path_factory.mktemp("ir") / "pipeline.yaml")


def test_committed_pipeline_yaml_is_current(compiled):
    assert COMMITTED.exists(), "pipeline.yaml missing: run `ctrflow pipeline compile`"
    assert COMMITTED.read_text() == compiled.read_text(), \
        "pipeline.yaml is stale: run `ctrflow pipeline compile` and commit it"


def test_only_gpu_branch_tasks_request_gpus(compiled):
    spec = yaml.safe_load(compiled.read_text())
    executors = spec["deploymentSpec"]["executors"]
    requesting = {name for name, ex in executors.items() if "accelerator" in ex.get("container", {}).get("resources", {})}
    trains = {name for name in executors if name.startswith("exec-train")}
    assert len(requesting) == 2 and requesting < trains  # one GPU train per data branch, the CPU ones ask nothing
    for name in requesting:
        accelerator = executors[name]["container"]["resources"]["accelerator"]
        assert accelerator["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--num_gpus']}}"
    assert set(spec["root"]["inputDefinitions"]["parameters"]) >= {
        "raw_data", "model", "freq_threshold", "epochs", "batch_size", "num_gpus", "mlflow_tracking_uri",
        "mlflow_experiment"}


def test_cli_flags_become_pipeline_parameters():
    argv = ["pipeline", "run", "--local", "--synth-rows", "1000", "--model", "dcnv2", "--learning-rate", "0.01"]
    args = build_parser(argv).parse_args(argv)
    assert parameter_values(args) == {"synth_rows": 1000, "model": "dcnv2", "learning_rate": 0.01}


class FakeKfpApi(BaseHTTPRequestHandler):
    """The four v2beta1 endpoints `kfp.Client` calls to create a run; records what it received."""

    received: list = []

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.received.append(("GET", self.path.split("?")[0], None))
        if self.path.startswith("/apis/v2beta1/healthz"):
            self._reply({"multi_user": False})
        elif self.path.startswith("/apis/v2beta1/experiments"):
            self._reply({"experiments": [], "total_size": 0})
        else:
            self.send_error(404)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append(("POST", self.path, body))
        if self.path == "/apis/v2beta1/experiments":
            self._reply({"experiment_id": "exp-1", "display_name": body["display_name"]})
        elif self.path == "/apis/v2beta1/runs":
            self._reply({"run_id": "run-42", "display_name": body["display_name"],
                         "experiment_id": body.get("experiment_id"), "state": "PENDING"})
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def kfp_api():
    FakeKfpApi.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfpApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeKfpApi.received
    server.shutdown()
    server.server_close()


def test_submit_posts_compiled_spec_and_parameters(kfp_api):
    host, received = kfp_api
    run_id = submit_kfp(host, {"synth_rows": 1000, "model": "dcnv2"}, experiment="ctr-exp", run_name="nightly")
    assert run_id == "run-42"
    posted = {path: body for method, path, body in received if method == "POST"}
    assert posted["/apis/v2beta1/experiments"]["display_name"] == "ctr-exp"
    run = posted["/apis/v2beta1/runs"]
    assert run["display_name"] == "nightly" and run["experiment_id"] == "exp-1"
    assert run["pipeline_spec"]["pipelineInfo"]["name"] == "ctrflow"
    assert "exec-train" in run["pipeline_spec"]["deploymentSpec"]["executors"]
    assert run["runtime_config"]["parameters"] == {"synth_rows": 1000, "model": "dcnv2"}


def test_vertex_submit_checks_root_and_names_the_missing_extra():
    with pytest.raises(UserError, match="gs://"):
        submit_vertex("proj", "us-central1", "/tmp/root", {})
    try:
        import google.cloud.aiplatform  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match=r"pip install 'ctrflow\[vertex\]'"):
            submit_vertex("proj", "us-central1", "gs://bucket/root", {})


def test_local_run_console_shows_only_task_progress():
    import io

    from pipelines.local import TaskProgress

    log, console = io.StringIO(), io.StringIO()
    progress = TaskProgress(log, console)
    progress.write("09:00 - INFO - Executing task 'synth'\n    [KFP Executor] Got executor_input: {\n")
    progress.write("    }\n09:01 - INFO - Task 'synth' finished with status SUCCESS\n")
    assert console.getvalue().splitlines() == ["09:00 - INFO - Executing task 'synth'",
                                               "09:01 - INFO - Task 'synth' finished with status SUCCESS"]
    assert log.getvalue().count("\n") == 4
