"""The whole KFP pipeline run by the local runner against a real MLflow server: one parent run,
a child run per step with its metrics and artifacts, and a registered model version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS = {"synth", "preprocess", "train", "evaluate", "export"}


@pytest.fixture(scope="module")
def client(pipeline_run):
    mlflow = pytest.importorskip("mlflow")
    return mlflow.MlflowClient(pipeline_run["url"], registry_uri=pipeline_run["url"])


def child_runs(client, pipeline_run) -> dict:
    experiment = client.get_experiment_by_name(pipeline_run["experiment"])
    children = client.search_runs([experiment.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{pipeline_run['mlflow_run_id']}'")
    return {run.data.tags["ctrflow.step"]: run for run in children}


def test_parent_run_closed_with_step_summary(client, pipeline_run):
    parent = client.get_run(pipeline_run["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["synth_rows"] == "4000" and parent.data.params["model"] == "dlrm"
    assert parent.data.tags["kfp.run_id"]
    assert parent.data.metrics["evaluate.auc"] == pytest.approx(pipeline_run["auc"])


def test_one_child_run_per_step_with_metrics_and_artifacts(client, pipeline_run):
    children = child_runs(client, pipeline_run)
    assert set(children) == STEPS
    assert all(run.info.status == "FINISHED" for run in children.values())
    kfp_run = client.get_run(pipeline_run["mlflow_run_id"]).data.tags["kfp.run_id"]
    assert {run.data.tags["kfp.run_id"] for run in children.values()} == {kfp_run}
    evaluate = children["evaluate"]
    assert evaluate.data.metrics["auc"] == pytest.approx(pipeline_run["auc"])
    assert 0.5 < pipeline_run["auc"] < 1.0  # 4000 rows of a learnable teacher: better than chance
    assert "loss" in children["train"].data.metrics
    assert children["preprocess"].data.metrics["rows_train"] == 4000
    listed = {a.path for a in client.list_artifacts(evaluate.info.run_id, "evaluate")}
    assert {"evaluate/metrics.json", "evaluate/roc.png"} <= listed
    schema_hash = children["preprocess"].data.tags["vocab_hash"]
    assert children["evaluate"].data.tags["schema_hash"] == schema_hash


def test_export_registered_as_candidate(client, pipeline_run):
    name = pipeline_run["model_name"]
    version = client.get_model_version_by_alias(name, "candidate")
    assert str(version.version) == pipeline_run["registered_version"] == "1"
    export_run = child_runs(client, pipeline_run)["export"].info.run_id
    assert version.run_id == export_run
    artifact_path = version.source.rsplit("/artifacts/", 1)[1]  # the version points into the run's artifacts
    assert artifact_path in {a.path for a in client.list_artifacts(export_run)}


def test_local_outputs_on_disk(pipeline_run):
    repository = Path(pipeline_run["repository"])
    assert (repository / pipeline_run["model_name"] / "config.pbtxt").exists()
    validation = json.loads((repository / "validation.json").read_text())
    assert validation["max_abs_diff"] <= 1e-5
    assert 0.75 <= pipeline_run["teacher_auc"] <= 0.85
