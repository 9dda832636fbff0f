"""The whole KFP pipeline with every task in the training image (`run_local(..., runner="docker")`,
KFP's DockerRunner through a Docker engine or podman's Docker API): the same MLflow runs, registered
version and outputs on disk as the subprocess runner gives, checked by the same tests. The tasks reach
the MLflow server on the host over the host's network."""

from __future__ import annotations

import re

import pytest

from tests.fixtures.containers import docker_host, train_image  # noqa: F401  (fixtures)
from tests.integration.conftest import EXPERIMENT, MODEL_NAME
from tests.integration.test_pipeline_local import (  # noqa: F401  (collected here, on this module's run)
    client, test_export_registered_as_candidate, test_local_outputs_on_disk,
    test_one_child_run_per_step_with_metrics_and_artifacts, test_parent_run_closed_with_step_summary)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pipeline_run(mlflow_server, tmp_path_factory, train_image):
    """One run of the whole pipeline in containers of the training image, tracked in `mlflow_server`."""
    from ctrflow_pipelines.compile import tasks_in
    from ctrflow_pipelines.local import run_local, summarize_local_run

    root = tmp_path_factory.mktemp("pipeline_root_docker")
    arguments = {"synth_rows": 4000, "synth_days": 2, "seed": 3, "freq_threshold": 2, "batch_size": 64,
                 "embedding_dim": 8, "model_name": MODEL_NAME + "_docker", "mlflow_tracking_uri": mlflow_server,
                 "mlflow_experiment": EXPERIMENT + "-docker"}
    with tasks_in(train_image):
        run_dir = run_local(root, arguments, log_file=root / "tasks.log", runner="docker")
    return {**summarize_local_run(run_dir), "url": mlflow_server, "experiment": EXPERIMENT + "-docker",
            "model_name": MODEL_NAME + "_docker", "log": (root / "tasks.log").read_text()}


def test_every_task_ran_in_the_image(pipeline_run, train_image):
    log = re.sub(r"\x1b\[[0-9;]*m", "", pipeline_run["log"])
    tasks = re.findall(r"Executing task '([\w-]+)'", log)
    assert {"raw-data", "train", "evaluate", "export"} <= set(tasks)
    assert log.count(f"Found image '{train_image}'") == len(tasks)
