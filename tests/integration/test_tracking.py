"""MLflow tracking against a real SQLite store in a temp dir: nesting, artifacts, registry."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from ctrflow.tracking import NullTracker, finish_pipeline_run, make_tracker, start_pipeline_run

pytestmark = pytest.mark.integration

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite store for the module: creating its tables takes seconds, so tests share it."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


def test_child_run_nests_under_parent_with_params_metrics_artifacts(store, tmp_path):
    parent_id = start_pipeline_run(store, "exp", "pipeline", "kfp-123", {"model": "dlrm", "epochs": 1})
    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "1" / "model.onnx").write_bytes(b"onnx")
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"')
    (tmp_path / "schema.json").write_text("{}")
    with make_tracker(store, "exp", "train", parent_run_id=parent_id, tags={"ctrflow.step": "train"}) as t:
        t.log_params({"lr": 0.01, "skipped": None})
        t.log_metrics({"loss": 0.5}, step=1)
        t.log_metrics({"loss": 0.4, "auc": 0.75}, step=2)
        t.log_artifact(tmp_path / "schema.json")
        t.log_artifact(tmp_path / "repo", "triton")
        child_id = t.run_id

    client = mlflow.MlflowClient(store)
    child = client.get_run(child_id)
    assert child.data.tags["mlflow.parentRunId"] == parent_id
    assert child.info.status == "FINISHED"
    assert child.data.params == {"lr": "0.01"}
    assert [m.value for m in client.get_metric_history(child_id, "loss")] == [0.5, 0.4]
    listed = {a.path for a in client.list_artifacts(child_id)}
    assert listed == {"schema.json", "triton"}
    assert [a.path for a in client.list_artifacts(child_id, "triton/m/1")] == ["triton/m/1/model.onnx"]
    # a SQLite store keeps artifacts beside the database, not in the working directory
    assert child.info.artifact_uri.startswith((Path(store[len("sqlite:///"):]).parent / "mlruns").as_uri())
    parent = client.get_run(parent_id)
    assert parent.data.tags["kfp.run_id"] == "kfp-123"
    assert parent.data.params == {"model": "dlrm", "epochs": "1"}
    assert parent.info.status == "RUNNING"


def test_finish_pipeline_run_closes_parent_with_step_metrics(store):
    parent_id = start_pipeline_run(store, "exp2", "pipeline", "kfp-9", {})
    with make_tracker(store, "exp2", "evaluate", parent_run_id=parent_id,
                      tags={"ctrflow.step": "evaluate", "kfp.run_id": "kfp-9"}) as t:
        t.log_metrics({"auc": 0.77, "logloss": 0.45})

    assert finish_pipeline_run(store, "exp2", "kfp-9", "FAILED") == parent_id
    parent = mlflow.MlflowClient(store).get_run(parent_id)
    assert parent.info.status == "FAILED"
    assert parent.data.metrics == {"auc": 0.77, "logloss": 0.45, "evaluate.auc": 0.77, "evaluate.logloss": 0.45}
    assert finish_pipeline_run(store, "exp2", "no-such-run", "FINISHED") is None


def test_the_pipeline_run_shows_the_values_its_steps_used_for_the_defaults(store):
    given = {"learning_rate": "0", "batch_size": "0", "freq_threshold": "0", "raw_data": "", "model": "dlrm",
             "seed": "0", "embedding_dim": "8"}
    parent_id = start_pipeline_run(store, "exp4", "pipeline", "kfp-4", given)
    with make_tracker(store, "exp4", "train", parent_id, {"ctrflow.step": "train"}) as trained:
        trained.log_params({"optim.lr": 0.001, "data.batch_size": 2048, "model.embedding_dim": 8})
    with make_tracker(store, "exp4", "preprocess", parent_id, {"ctrflow.step": "preprocess"}) as preprocessed:
        preprocessed.log_params({"freq_threshold": 6, "train": ["day_0.tsv"]})

    finish_pipeline_run(store, "exp4", "kfp-4", "FINISHED")
    assert mlflow.MlflowClient(store).get_run(parent_id).data.params == {
        "learning_rate": "0.001", "batch_size": "2048", "freq_threshold": "6", "raw_data": "['day_0.tsv']",
        "model": "dlrm", "seed": "0", "embedding_dim": "8"}


def test_parent_run_links_its_steps_the_model_and_carries_the_plots(store, tmp_path):
    client = mlflow.MlflowClient(store)
    parent_id = start_pipeline_run(store, "exp3", "pipeline", "kfp-5", {})
    steps = {"parent_run_id": parent_id}
    (tmp_path / "roc.png").write_bytes(b"\x89PNG plot")
    with make_tracker(store, "exp3", "evaluate", tags={"ctrflow.step": "evaluate"}, **steps) as evaluated:
        evaluated.log_metrics({"auc": 0.7512})
        evaluated.log_artifact(tmp_path / "roc.png", "evaluate")
    with make_tracker(store, "exp3", "export", tags={"ctrflow.step": "export"}, **steps) as exported:
        version = exported.register_model("ctr_links", tmp_path)

    finish_pipeline_run(store, "exp3", "kfp-5", "FINISHED")

    parent = client.get_run(parent_id)
    experiment = parent.info.experiment_id
    note = parent.data.tags["mlflow.note.content"]
    assert note.splitlines()[0] == ("**ctrflow pipeline run**: validation AUC 0.7512 (step evaluate), registered model "
                                    f"**ctr_links version {version}** (alias candidate).")
    assert "](" not in note  # no links: MLflow opens a description's links in a new tab
    assert parent.data.tags["ctrflow.registered_model"] == f"ctr_links/{version}"
    # the version's logged model is an output of the export run and of the pipeline run: both show it
    [model_id] = [m.model_id for m in client.get_run(parent_id).outputs.model_outputs]
    assert [m.model_id for m in client.get_run(exported.run_id).outputs.model_outputs] == [model_id]
    model = client.get_logged_model(model_id)
    assert model.source_run_id == exported.run_id and model.experiment_id == experiment
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": "ctr_links", "version": version}]
    assert [a.path for a in client.list_artifacts(parent_id, "evaluate")] == ["evaluate/roc.png"]
    tags = client.get_experiment(experiment).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert json.loads(tags["mlflow.sharedViewState.ctrflow-runs"])["selectedColumns"] == ["metrics.`auc`",
                                                                                         "metrics.`logloss`"]


def test_register_model_versions_and_candidate_alias(store, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "config.pbtxt").write_text('name: "ctr"')
    versions, runs = [], []
    for _ in range(2):
        with make_tracker(store, "exp", "export") as t:
            versions.append(t.register_model("ctr", tmp_path / "repo", description="test", backend="onnxruntime"))
            runs.append(t.run_id)
    assert versions == ["1", "2"]
    client = mlflow.MlflowClient(store, registry_uri=store)
    assert client.list_artifacts(runs[0]) == []  # the files went to the version's logged model only
    assert str(client.get_model_version_by_alias("ctr", "candidate").version) == "2"
    first = client.get_model_version("ctr", "1")
    assert first.tags == {"backend": "onnxruntime"}
    local = mlflow.artifacts.download_artifacts(artifact_uri=first.source, dst_path=str(tmp_path / "got"))
    assert (Path(local) / "config.pbtxt").read_text() == 'name: "ctr"'  # the version's files


def test_exception_in_block_marks_run_failed(store):
    with pytest.raises(RuntimeError):
        with make_tracker(store, "exp", "train") as t:
            raise RuntimeError("diverged")
    assert mlflow.MlflowClient(store).get_run(t.run_id).info.status == "FAILED"


def test_tracking_uri_none_tracks_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert isinstance(make_tracker("none"), NullTracker)
    assert start_pipeline_run("none", "exp", "pipeline", "kfp-1", {"a": 1}) == ""
    assert finish_pipeline_run("none", "exp", "kfp-1", "FINISHED") is None
    assert list(tmp_path.iterdir()) == []


def test_tracking_argv_round_trips_through_step_flags():
    import argparse

    from ctrflow.tracking import add_tracking_flags, tracking_argv

    parser = argparse.ArgumentParser()
    add_tracking_flags(parser)
    args = parser.parse_args(tracking_argv("http://mlflow:5000", "exp", "parent-1", {"kfp.run_id": "7", "x": ""}))
    assert (args.tracking_uri, args.experiment, args.parent_run_id, args.tag) == \
        ("http://mlflow:5000", "exp", "parent-1", ["kfp.run_id=7"])
    assert parser.parse_args(tracking_argv()).tracking_uri is None  # "" leaves the step's default
