"""The pipeline with `train_nodes=2` on this machine (KFP's subprocess runner): its train task runs a
Kubeflow Trainer TrainJob of two containers of the training image (the container backend, gloo on
the CPU), streams node 0's log into its own and publishes the job's checkpoint as its output. Evaluate
and export then give what in-task training gives on the same data: the same losses step by step,
the same AUC, a validated repository; the job's folder and containers are gone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.fixtures.containers import docker_host, train_image  # noqa: F401  (fixtures)
from tests.fixtures.ranks import losses

pytestmark = [pytest.mark.integration, pytest.mark.containers]  # make test-containers
pytest.importorskip("kubeflow.trainer")
ARGUMENTS = {"synth_rows": 3000, "synth_days": 2, "seed": 3, "freq_threshold": 2, "batch_size": 64,
             "embedding_dim": 8, "max_steps": 24, "mlflow_tracking_uri": "none"}


@pytest.fixture(scope="module")
def runs(train_image, tmp_path_factory):
    """The pipeline on one node (in the task) and on two (a TrainJob), same parameters."""
    from ctrflow_pipelines.local import run_local, summarize_local_run

    root = tmp_path_factory.mktemp("nodes")
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))  # the container backend's job folders go under it
        patch.setenv("CTRFLOW_IMAGE", train_image)  # the image of the job's nodes: the task's own
        for nodes in (1, 2):
            log = root / f"{nodes}.log"
            run_dir = run_local(root / str(nodes), {**ARGUMENTS, "train_nodes": nodes}, log_file=log)
            found[nodes] = {**summarize_local_run(run_dir), "run_dir": run_dir, "log": log.read_text()}
    return found | {"home": root / "home"}


def checkpoint(run: dict) -> Path:
    from ctrflow_pipelines.local import task_output

    return task_output(run["run_dir"], "train", "checkpoint")


def test_two_nodes_train_what_the_task_trains(runs):
    one, two = runs[1], runs[2]
    got, ref = losses(checkpoint(two)), losses(checkpoint(one))
    assert len(got) == len(ref) > 0
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-4
    assert sorted(p.name for p in checkpoint(two).iterdir()) == sorted(p.name for p in checkpoint(one).iterdir())
    assert two["auc"] == pytest.approx(one["auc"], abs=1e-4)
    assert two["rows"] == one["rows"]
    for run in (one, two):
        assert json.loads((Path(run["repository"]) / "validation.json").read_text())["max_abs_diff"] <= 1e-5


def test_the_task_ran_a_two_node_trainjob_and_left_nothing_behind(runs, docker_host):
    import contextlib

    import docker

    log = re.sub(r"\x1b\[[0-9;]*m", "", runs[2]["log"])
    name = re.search(r"TrainJob (ctrflow-train-[0-9a-f]{8}): Complete", log).group(1)
    assert re.search(r"processes\s+2", log)  # node 0's log, in the task's
    assert "TrainJob" not in runs[1]["log"]
    meta = json.loads(next(runs[2]["run_dir"].glob("train*/executor_output.json")).read_text())
    assert meta["artifacts"]["checkpoint"]["artifacts"][0]["metadata"]["nodes"] == 2
    assert not list((runs["home"] / ".kubeflow" / "trainer" / "containers").iterdir())  # its folder, removed
    with contextlib.closing(docker.DockerClient(base_url=docker_host)) as client:
        assert not client.containers.list(all=True, filters={"name": name})
