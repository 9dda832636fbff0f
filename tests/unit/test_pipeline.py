"""The pipeline definition: committed IR is current, one train task for CPU and GPUs, preprocessing
fanned out and cacheable, the CLI
maps flags to parameters, and `submit` sends the KFP v2beta1 API what a real server expects."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from ctrflow.cli import build_parser, main
from ctrflow.errors import UserError

pytest.importorskip("kfp")

from ctrflow_pipelines.cli import parameter_values  # noqa: E402
from ctrflow_pipelines.compile import COMMITTED, DAILY_COMMITTED, compile_pipeline  # noqa: E402
from ctrflow_pipelines.submit import submit_kfp, submit_vertex  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    return compile_pipeline(tmp_path_factory.mktemp("ir") / "pipeline.yaml")


@pytest.fixture(scope="module")
def daily(tmp_path_factory) -> Path:
    return compile_pipeline(tmp_path_factory.mktemp("ir") / "daily_pipeline.yaml", "daily")


def test_committed_pipeline_yaml_is_current(compiled):
    assert COMMITTED.exists(), "pipeline.yaml missing: run `ctrflow pipeline compile`"
    assert COMMITTED.read_text() == compiled.read_text(), \
        "pipeline.yaml is stale: run `ctrflow pipeline compile` and commit it"


def test_committed_daily_pipeline_yaml_is_current(daily):
    assert DAILY_COMMITTED.exists(), "daily_pipeline.yaml missing: run `ctrflow pipeline compile`"
    assert DAILY_COMMITTED.read_text() == daily.read_text(), \
        "daily_pipeline.yaml is stale: run `ctrflow pipeline compile` and commit it"


def test_the_daily_cycle_chains_vocabulary_warm_start_base_and_gate(daily):
    spec = load_spec(daily)
    tasks = tasks_of(spec)
    inputs = {name: task["inputs"]["parameters"] for name, task in tasks.items() if "parameters" in task.get("inputs", {})}
    from_state = {"preprocess-day": "vocab_from", "train": "init_from", "export": "base"}
    for task, parameter in from_state.items():
        given = inputs[task][parameter]  # the train task sits in a branch (one node or a TrainJob): a channel into it
        assert given.get("taskOutputParameter") == {"outputParameterKey": parameter, "producerTask": "day-inputs"} \
            or given == {"componentInputParameter": f"pipelinechannel--day-inputs-{parameter}"}, task
    assert inputs["raw-data"]["train_files"]["taskOutputParameter"]["producerTask"] == "day-inputs"
    assert inputs["day-inputs"]["days_back"] == {"componentInputParameter": "pipelinechannel--days_back"}
    assert {"export", "preprocess-day", "condition-branches-2"} <= set(tasks["promote-day"]["dependentTasks"])
    assert tasks["promote-day"]["inputs"]["parameters"]["min_gain"] == {"componentInputParameter": "pipelinechannel--min_gain"}
    for name in ("day-inputs", "raw-data", "preprocess-day", "train", "train-2", "evaluate", "export", "promote-day"):
        assert tasks[name].get("cachingOptions", {}) == {}, name  # never reused: the state changes daily


def load_spec(path: Path) -> dict:
    """The pipeline spec with its Kubernetes platform spec (the YAML's second document) under `platforms`."""
    spec, *platform = yaml.safe_load_all(path.read_text())
    return {**spec, **(platform[0] if platform else {})}


def tasks_of(spec: dict) -> dict:
    """Every task of the compiled pipeline by name, loops and exit handler included."""
    return {name: task for dag in spec["components"].values() if "dag" in dag
            for name, task in dag["dag"]["tasks"].items()}


def test_one_train_task_serves_cpu_and_gpus(compiled):
    spec = load_spec(compiled)
    executors = spec["deploymentSpec"]["executors"]
    assert {n for n in executors if n.startswith(("exec-train", "exec-evaluate", "exec-export"))} == {
        "exec-train", "exec-train-2", "exec-evaluate", "exec-export"}  # one train task here, one launching a TrainJob
    requesting = {n for n, ex in executors.items() if "accelerator" in ex["container"].get("resources", {})}
    assert requesting == {"exec-train", "exec-tune"}  # the tuning stage's trials train on the same resources
    for name, kind in (("train", "accelerator-type-2"), ("tune", "accelerator-type")):
        accelerator = executors[f"exec-{name}"]["container"]["resources"]["accelerator"]
        assert accelerator["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--num_gpus']}}"
        # the type comes from a task that answers "" on CPU: the KFP driver then sets no GPU limit at all
        assert accelerator["resourceType"] == f"{{{{$.inputs.parameters['pipelinechannel--{kind}-Output']}}}}"
        assert kind in tasks_of(spec)[name]["dependentTasks"]
        shm = spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"][f"exec-{name}"]["emptyDirMounts"]
        assert shm == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi", "volumeName": "dshm"}]
    assert set(spec["root"]["inputDefinitions"]["parameters"]) >= {
        "raw_data", "dataset", "model", "freq_threshold", "epochs", "batch_size", "num_gpus", "mlflow_tracking_uri",
        "mlflow_experiment"}


def test_several_nodes_train_as_a_trainjob_sharing_the_pipeline_volume(compiled):
    spec = load_spec(compiled)
    tasks = tasks_of(spec)
    branches = {name: task["triggerPolicy"]["condition"] for name, task in tasks.items() if "triggerPolicy" in task}
    assert sorted(branches.values()) == ["!(int(inputs.parameter_values['pipelinechannel--train_nodes']) == 1)",
                                         "int(inputs.parameter_values['pipelinechannel--train_nodes']) == 1"]
    assert spec["root"]["inputDefinitions"]["parameters"]["train_nodes"]["defaultValue"] == 1  # in-task training
    job = tasks["train-2"]["inputs"]["parameters"]
    assert job["nodes"] == {"componentInputParameter": "pipelinechannel--train_nodes"}
    assert "resources" not in spec["deploymentSpec"]["executors"]["exec-train-2"]["container"]  # its nodes hold the GPUs
    mounts = spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train-2"]["pvcMount"]
    assert [(m["mountPath"], m["pvcNameParameter"]) for m in mounts] == [
        ("/mnt/ctrflow", {"componentInputParameter": "pipelinechannel--train_volume"})]
    assert "pvcMount" not in spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train"]


def test_tuning_stage_hands_its_best_config_to_the_one_train_task(compiled):
    spec = load_spec(compiled)
    tasks = tasks_of(spec)
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["tune_trials"]["defaultValue"] == 0  # optional: off unless asked for
    assert yaml.safe_load(params["tune_space"]["defaultValue"])["lr"]["log"] is True
    for train in ("train", "train-2"):  # in either branch, through a channel into it
        assert tasks[train]["inputs"]["parameters"]["config"] == {"componentInputParameter": "pipelinechannel--tune-Output"}
    branches = tasks["condition-branches-4"]["inputs"]
    assert branches["parameters"]["pipelinechannel--tune-Output"]["taskOutputParameter"] == {
        "outputParameterKey": "Output", "producerTask": "tune"}
    assert tasks["tune"]["inputs"]["artifacts"]["data"] == branches["artifacts"]["pipelinechannel--finalize-data-data"]
    assert tasks["tune"]["inputs"]["parameters"]["trials"]["componentInputParameter"] == "pipelinechannel--tune_trials"


def test_dataset_parameter_reaches_the_raw_data_task(compiled):
    spec = load_spec(compiled)
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["dataset"]["defaultValue"] == "criteo"
    assert parameters["freq_threshold"]["defaultValue"] == 0  # 0: the description's own threshold
    given = tasks_of(spec)["raw-data"]["inputs"]["parameters"]["dataset"]
    assert given == {"componentInputParameter": "pipelinechannel--dataset"}


def test_accelerator_type_is_empty_without_gpus():
    import ctrflow_components as components

    assert components.accelerator_type.python_func(num_gpus=0, gpu_type="nvidia.com/gpu") == ""
    assert components.accelerator_type.python_func(num_gpus=4, gpu_type="nvidia.com/gpu") == "nvidia.com/gpu"


def test_preprocessing_fans_out_over_the_raw_files(compiled):
    spec = load_spec(compiled)
    loops = [c for c in spec["components"].values() if "dag" in c and "count-values" in c["dag"]["tasks"]
             or "dag" in c and "transform-file" in c["dag"]["tasks"]]
    assert len(loops) == 2
    tasks = tasks_of(spec)
    for name in ("for-loop-2", "for-loop-3"):
        iterator = tasks[name]["parameterIterator"]
        assert iterator["items"]["inputParameter"] == "pipelinechannel--raw-data-Output"
    assert {"merge-counts", "finalize-data"} <= set(tasks)
    assert "count-values" in str(tasks["merge-counts"]["inputs"])  # collected from the count loop


def test_data_tasks_are_cacheable_across_runs(compiled):
    spec = load_spec(compiled)
    tasks = tasks_of(spec)
    for name in ("raw-data", "count-values", "merge-counts", "transform-file", "finalize-data"):
        inputs = yaml.safe_dump(tasks[name]["inputs"])
        assert "start-run" not in inputs and "PIPELINE_JOB_ID" not in inputs and "pipeline_job" not in inputs, name
        assert tasks[name]["cachingOptions"] == {"enableCache": True}, name
    assert tasks["track-data"]["cachingOptions"] == {}  # always logs the data to this run
    assert "start-run" in yaml.safe_dump(tasks["track-data"]["inputs"])


def test_export_gets_evaluate_report(compiled):
    tasks = tasks_of(load_spec(compiled))
    report = tasks["export"]["inputs"]["artifacts"]["report"]["taskOutputArtifact"]
    assert report == {"outputArtifactKey": "report", "producerTask": "evaluate"}


def test_cli_flags_become_pipeline_parameters():
    argv = ["pipeline", "run", "--local", "--synth-rows", "1000", "--model", "dcnv2", "--learning-rate", "0.01",
            "--dataset", "movielens-like"]
    args = build_parser(argv).parse_args(argv)
    assert parameter_values(args) == {"synth_rows": 1000, "model": "dcnv2", "learning_rate": 0.01,
                                      "dataset": "movielens-like"}


def images_of(path: Path) -> set[str]:
    """The container images a compiled pipeline's tasks run in."""
    executors = next(yaml.safe_load_all(path.read_text()))["deploymentSpec"]["executors"]
    return {e["container"]["image"] for e in executors.values() if "container" in e}


def test_compile_out_writes_the_main_pipeline_in_the_image_given(tmp_path, capsys):
    from ctrflow_components.image import TRAIN_IMAGE

    assert main(["pipeline", "compile", "--out", str(tmp_path / "p.yaml"), "--image", "registry.example/ctr:7"]) == 0
    assert next(yaml.safe_load_all((tmp_path / "p.yaml").read_text()))["pipelineInfo"]["name"] == "ctrflow"
    assert images_of(tmp_path / "p.yaml") == {"registry.example/ctr:7"}
    job = next(yaml.safe_load_all((tmp_path / "p.yaml").read_text()))["deploymentSpec"]["executors"]["exec-train-2"]
    assert job["container"]["env"] == [{"name": "CTRFLOW_IMAGE", "value": "registry.example/ctr:7"}]  # its nodes' image
    assert main(["pipeline", "compile", "--out", str(tmp_path / "d.yaml"), "--pipeline", "daily"]) == 0
    assert images_of(tmp_path / "d.yaml") == {TRAIN_IMAGE}  # --image held for its own command only


def test_committed_pipelines_name_the_local_build_not_a_published_tag():
    assert images_of(COMMITTED) == images_of(DAILY_COMMITTED) == {"localhost/ctrflow/ctrflow-train:0.1.0"}


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
        elif self.path == "/apis/v2beta1/recurringruns":
            self._reply({**body, "recurring_run_id": "recurring-7", "status": "ENABLED"})
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
    # with a Kubernetes platform spec the API takes both, side by side
    pipeline, platform = run["pipeline_spec"]["pipeline_spec"], run["pipeline_spec"]["platform_spec"]
    assert pipeline["pipelineInfo"]["name"] == "ctrflow"
    assert "exec-train" in pipeline["deploymentSpec"]["executors"]
    assert "exec-train" in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert run["runtime_config"]["parameters"] == {"synth_rows": 1000, "model": "dcnv2"}


def test_schedule_creates_a_daily_recurring_run(kfp_api, capsys):
    from ctrflow.cli import main

    host, received = kfp_api
    assert main(["pipeline", "schedule", "--cron", "0 3 * * *", "--host", host, "--experiment", "nightly",
                 "--state", "/mnt/state", "--raw-dir", "gs://logs/days", "--day-files", "{date}/*.tsv",
                 "--min-gain", "0.001"]) == 0
    assert "scheduled recurring run recurring-7" in capsys.readouterr().out
    posted = {path: body for method, path, body in received if method == "POST"}
    assert posted["/apis/v2beta1/experiments"]["display_name"] == "nightly"
    recurring = posted["/apis/v2beta1/recurringruns"]
    assert recurring["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * *"}}  # KFP's cron: seconds first
    assert recurring["display_name"] == "ctrflow-daily" and recurring["experiment_id"] == "exp-1"
    assert recurring["mode"] == "ENABLE" and recurring["max_concurrency"] in (1, "1") and recurring["no_catchup"] is True
    assert recurring["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "ctrflow-daily"
    assert recurring["runtime_config"]["parameters"] == {"state": "/mnt/state", "raw_dir": "gs://logs/days",
                                                         "day_files": "{date}/*.tsv", "min_gain": 0.001}


def test_schedule_refuses_a_bad_cron_and_flags_of_the_other_pipeline(kfp_api):
    from ctrflow.cli import main

    host, received = kfp_api
    assert main(["pipeline", "schedule", "--cron", "0 3 * *", "--host", host, "--state", "s", "--raw-dir", "r"]) == 2
    assert main(["pipeline", "schedule", "--cron", "0 3 * * *", "--host", host, "--synth-rows", "10"]) == 2
    assert main(["pipeline", "schedule", "--cron", "0 3 * * *", "--host", host, "--raw-dir", "r"]) == 2  # no --state
    assert received == []  # refused before any request


def test_the_day_files_of_a_scheduled_run_name_the_day_before():
    from datetime import datetime, timezone

    from ctrflow.daily import resolve_day_files

    at_three = datetime(2026, 11, 26, 3, 0, tzinfo=timezone.utc)
    assert resolve_day_files("{date}/*.tsv", at_three) == "2026-11-25/*.tsv"  # yesterday's logs, complete
    assert resolve_day_files("{date}/*.tsv", at_three, days_back=0) == "2026-11-26/*.tsv"
    assert resolve_day_files("day_3.*", at_three) == "day_3.*"


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

    from ctrflow_pipelines.local import TaskProgress

    log, console = io.StringIO(), io.StringIO()
    progress = TaskProgress(log, console)
    progress.write("09:00 - INFO - Executing task 'synth'\n    [KFP Executor] Got executor_input: {\n")
    progress.write("    }\n09:01 - INFO - Task 'synth' finished with status SUCCESS\n")
    assert console.getvalue().splitlines() == ["09:00 - INFO - Executing task 'synth'",
                                               "09:01 - INFO - Task 'synth' finished with status SUCCESS"]
    assert log.getvalue().count("\n") == 4
