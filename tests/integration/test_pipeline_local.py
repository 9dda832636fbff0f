"""The whole KFP pipeline run by the local runner against a real MLflow server: one parent run,
a child run per step with its metrics and artifacts, a registered model version tagged with its
AUC, and the per-file preprocessing fan-out giving exactly the single-process output."""

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
    assert float(version.tags["auc"]) == pytest.approx(pipeline_run["auc"])  # what `ctrflow promote` compares
    export_run = child_runs(client, pipeline_run)["export"].info.run_id
    assert version.run_id == export_run
    # the version's files are those of a logged model (`.../models/<model id>/artifacts`) the export run made
    model_id = version.source.rsplit("/models/", 1)[1].split("/")[0]
    assert client.get_logged_model(model_id).source_run_id == export_run


def test_local_outputs_on_disk(pipeline_run):
    repository = Path(pipeline_run["repository"])
    assert (repository / pipeline_run["model_name"] / "config.pbtxt").exists()
    validation = json.loads((repository / "validation.json").read_text())
    assert validation["max_abs_diff"] <= 1e-5
    assert 0.75 <= pipeline_run["teacher_auc"] <= 0.85


def assert_same_as_single_process(run_dir: Path, train: list, valid: list, **options) -> None:
    """The pipeline's fan-out output equals `ctrflow preprocess` in one process on the same raw files."""
    import pyarrow.parquet as pq

    from ctrflow.ingest.run import preprocess
    from ctrflow.contract.schema import Schema

    raw, data = run_dir / "raw-data" / "raw", run_dir / "finalize-data" / "data"
    single = run_dir.parent / f"{run_dir.name}-single"
    preprocess([raw / n for n in train], [raw / n for n in valid], single, workers=1, **options)
    for split in ("train", "valid"):
        names = sorted(p.name for p in (single / split).glob("part-*.parquet"))
        assert names and sorted(p.name for p in (data / split).glob("part-*.parquet")) == names
        for name in names:
            assert pq.read_table(data / split / name).equals(pq.read_table(single / split / name))
    mine, reference = Schema.load(data), Schema.load(single)
    assert (mine.vocab_hash, mine.cardinalities, mine.rows) == (reference.vocab_hash, reference.cardinalities,
                                                                reference.rows)


def test_fanned_out_preprocessing_equals_single_process(pipeline_run):
    assert_same_as_single_process(Path(pipeline_run["run_dir"]), ["day_0.tsv"], ["day_1.tsv"], freq_threshold=2)


def test_given_raw_files_with_valid_fraction(pipeline_run, tmp_path):
    """Three given files (copied by raw_data, no synthesis), a held-out fraction, tracking off."""
    import os
    import shutil

    from ctrflow_pipelines.local import run_local, summarize_local_run

    given = tmp_path / "given"
    given.mkdir()
    synthetic = Path(pipeline_run["run_dir"]) / "raw-data" / "raw"
    for i, name in enumerate(["day_0.tsv", "day_1.tsv", "day_0.tsv"]):  # a third file: a copy
        shutil.copy(synthetic / name, given / f"part_{i}.tsv")
    arguments = {"raw_data": str(given), "train_files": "part_*.tsv", "valid_files": "", "valid_fraction": 0.2,
                 "freq_threshold": 3, "batch_size": 256, "embedding_dim": 4, "max_steps": 3,
                 "mlflow_tracking_uri": "none"}
    cwd = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[2])  # the tasks import the repository's packages
    try:
        run_dir = run_local(tmp_path / "root", arguments)
    finally:
        os.chdir(cwd)
    summary = summarize_local_run(run_dir)
    assert summary["rows"] > 0 and "teacher_auc" not in summary  # not synthetic: no teacher
    assert sorted(p.name for p in (run_dir / "raw-data" / "raw").iterdir()) == [f"part_{i}.tsv" for i in range(3)]
    assert_same_as_single_process(run_dir, [f"part_{i}.tsv" for i in range(3)], [], freq_threshold=3,
                                  valid_fraction=0.2)


def test_movielens_like_dataset_runs_through_the_whole_pipeline(tmp_path):
    """`dataset` = "movielens-like": synthesized with its description, which the fan-out reads, down
    to a Triton ensemble whose inputs are the description's columns (tracking off)."""
    import os

    from ctrflow_pipelines.local import run_local, summarize_local_run
    from ctrflow.contract.schema import Schema

    arguments = {"dataset": "movielens-like", "synth_rows": 3000, "synth_days": 2, "seed": 5, "batch_size": 256,
                 "embedding_dim": 8, "max_steps": 6, "model": "deepfm", "export_backend": "python",
                 "model_name": "movies", "mlflow_tracking_uri": "none"}
    cwd = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[2])  # the tasks import the repository's packages
    try:
        run_dir = run_local(tmp_path / "root", arguments)
    finally:
        os.chdir(cwd)
    summary = summarize_local_run(run_dir)
    raw = run_dir / "raw-data" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == ["day_0.csv", "day_1.csv", "movielens.yaml", "synth.json"]
    assert 0.75 <= summary["teacher_auc"] <= 0.85 and 0.0 < summary["auc"] < 1.0 and summary["rows"] == 3000
    schema = Schema.load(run_dir / "finalize-data" / "data")
    assert schema.dataset["label"] == "liked" and schema.freq_threshold == 2  # the description's threshold
    assert [f.kind for f in schema.features.sparse] == ["categorical", "categorical", "multi_hot"]
    config = (Path(summary["repository"]) / "movies" / "config.pbtxt").read_text()
    assert all(f'name: "{c}"' in config for c in ("age", "price", "userId", "movieId", "genres"))
