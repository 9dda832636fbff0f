"""The whole KFP pipeline with every task in the training image (`run_local(..., runner="docker")`,
KFP's DockerRunner through a Docker engine or podman's Docker API) gives what the subprocess runner
gives on the same parameters: the same MLflow runs and metrics, a registered version, the same
outputs. The tasks reach the MLflow server on the host over the host's network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.fixtures.containers import docker_host, train_image  # noqa: F401  (fixtures)
from tests.integration.conftest import EXPERIMENT, MODEL_NAME

pytestmark = [pytest.mark.integration, pytest.mark.containers]  # make test-containers
STEPS = {"synth", "preprocess", "train", "evaluate", "export"}
DOCKER_EXPERIMENT, DOCKER_MODEL = EXPERIMENT + "-docker", MODEL_NAME + "_docker"


@pytest.fixture(scope="module")
def docker_run(train_image, mlflow_server, tmp_path_factory):  # no engine: skip before any server starts
    """The conftest's pipeline run, parameter for parameter, in containers of the training image."""
    from ctrflow_pipelines.compile import tasks_in
    from ctrflow_pipelines.local import run_local, summarize_local_run

    root = tmp_path_factory.mktemp("pipeline_root_docker")
    arguments = {"synth_rows": 4000, "synth_days": 2, "seed": 3, "freq_threshold": 2, "batch_size": 64,
                 "embedding_dim": 8, "model_name": DOCKER_MODEL, "mlflow_tracking_uri": mlflow_server,
                 "mlflow_experiment": DOCKER_EXPERIMENT}
    with tasks_in(train_image):
        run_dir = run_local(root, arguments, log_file=root / "tasks.log", runner="docker")
    return {**summarize_local_run(run_dir), "log": (root / "tasks.log").read_text()}


@pytest.fixture(scope="module")
def client(mlflow_server):
    mlflow = pytest.importorskip("mlflow")
    return mlflow.MlflowClient(mlflow_server, registry_uri=mlflow_server)


def step_runs(client, experiment: str, parent_run_id: str) -> dict:
    """The child runs of one pipeline run, by step."""
    found = client.get_experiment_by_name(experiment)
    children = client.search_runs([found.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return {run.data.tags["ctrflow.step"]: run for run in children}


def test_every_task_ran_in_the_image(docker_run, train_image):
    log = re.sub(r"\x1b\[[0-9;]*m", "", docker_run["log"])
    tasks = re.findall(r"Executing task '([\w-]+)'", log)
    assert {"raw-data", "train", "evaluate", "export"} <= set(tasks)
    assert log.count(f"Found image '{train_image}'") == len(tasks)


def test_same_mlflow_runs_and_metrics_as_the_subprocess_runner(docker_run, client, pipeline_run):
    assert client.get_run(docker_run["mlflow_run_id"]).info.status == "FINISHED"
    ours = step_runs(client, DOCKER_EXPERIMENT, docker_run["mlflow_run_id"])
    theirs = step_runs(client, EXPERIMENT, pipeline_run["mlflow_run_id"])
    assert set(ours) == set(theirs) == STEPS
    for step in STEPS:
        assert ours[step].info.status == "FINISHED"
        assert set(ours[step].data.metrics) == set(theirs[step].data.metrics), step
        assert set(ours[step].data.params) == set(theirs[step].data.params), step
    assert ours["preprocess"].data.tags["vocab_hash"] == theirs["preprocess"].data.tags["vocab_hash"]
    assert docker_run["auc"] == pytest.approx(pipeline_run["auc"], rel=1e-5)  # same data, same training
    assert ours["evaluate"].data.metrics["auc"] == pytest.approx(docker_run["auc"])


def test_registered_and_exported_as_the_subprocess_runner(docker_run, client):
    version = client.get_model_version_by_alias(docker_run["model_name"], "candidate")
    assert str(version.version) == docker_run["registered_version"] == "1"
    assert float(version.tags["auc"]) == pytest.approx(docker_run["auc"])
    repository = Path(docker_run["repository"])
    assert (repository / docker_run["model_name"] / "config.pbtxt").exists()
    assert json.loads((repository / "validation.json").read_text())["max_abs_diff"] <= 1e-5


def test_a_task_failing_in_its_container_fails_and_leaves_no_container(train_image, tmp_path):
    """A task that ends within a second, as the run-time checks do, still reports its own exit status."""
    import contextlib

    import docker
    import kfp.local

    from ctrflow_components.resources import accelerator_type
    from ctrflow_pipelines.local import containers_kept_until_read

    with contextlib.closing(docker.from_env()) as engine:
        before = {container.id for container in engine.containers.list(all=True)}
        kfp.local.init(runner=kfp.local.DockerRunner(), pipeline_root=str(tmp_path))
        with containers_kept_until_read():
            assert accelerator_type(num_gpus=1, gpu_type="NVIDIA_H100_80GB").output == "NVIDIA_H100_80GB"
            with pytest.raises(RuntimeError, match="FAILURE"):
                accelerator_type(num_gpus=-1, gpu_type="NVIDIA_H100_80GB")
        assert {container.id for container in engine.containers.list(all=True)} == before
