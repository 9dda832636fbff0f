"""Each component's body on tiny real data (`component.python_func` with artifacts in temp dirs):
it drives the step's CLI and describes its outputs in artifact metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("kfp")

from kfp import dsl  # noqa: E402

import ctrflow_components as components  # noqa: E402
from ctrflow.ingest.run import preprocess  # noqa: E402
from ctrflow.contract.schema import Schema

pytestmark = pytest.mark.integration

OFF = {"tracking_uri": "none"}  # module fixtures run before conftest's per-test tracking switch


def artifact(kind, folder: Path, name: str):
    return kind(name=name, uri=str(folder / name), metadata={})


def fan_out(tmp: Path, raw, files: list, freq_threshold: int = 2):
    """count each file -> merge -> transform each file -> finalize, as the pipeline wires them."""
    counts = [artifact(dsl.Artifact, tmp, f"counts-{f['index']}") for f in files]
    parts = [artifact(dsl.Artifact, tmp, f"parts-{f['index']}") for f in files]
    vocab, data = artifact(dsl.Artifact, tmp, "vocab"), artifact(dsl.Dataset, tmp, "data")
    for file, out in zip(files, counts):
        components.count_values.python_func(raw=raw, file=file, counts=out)  # with the file's --dataset
    components.merge_counts.python_func(counts=counts, vocab=vocab, freq_threshold=freq_threshold)
    for file, out in zip(files, parts):
        components.transform_file.python_func(raw=raw, file=file, vocab=vocab, parts=out)
    components.finalize_data.python_func(counts=counts, vocab=vocab, parts=parts, data=data)
    return data


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """raw_data (synthetic) -> fan-out preprocessing -> train -> evaluate -> export, each as its
    component's Python body."""
    tmp = tmp_path_factory.mktemp("components")
    out = {"raw": artifact(dsl.Dataset, tmp, "raw"), "checkpoint": artifact(dsl.Model, tmp, "checkpoint"),
           "metrics": artifact(dsl.Metrics, tmp, "metrics"), "report": artifact(dsl.Artifact, tmp, "report"),
           "repository": artifact(dsl.Model, tmp, "repository")}
    out["files"] = components.raw_data.python_func(source="", train_files="day_0.tsv*", valid_files=" day_1.tsv* ",
                                                   raw=out["raw"], synth_rows=3000, synth_days=2, seed=1)
    out["data"] = fan_out(tmp, out["raw"], out["files"])
    components.train.python_func(data=out["data"], checkpoint=out["checkpoint"], batch_size=512,
                                 embedding_dim=4, max_steps=4, **OFF)
    components.evaluate.python_func(data=out["data"], checkpoint=out["checkpoint"], metrics=out["metrics"],
                                    report=out["report"], **OFF)
    components.export.python_func(data=out["data"], checkpoint=out["checkpoint"], report=out["report"],
                                  repository=out["repository"], name="tiny", **OFF)
    return out


def test_raw_data_and_preprocess_describe_their_data(chain):
    raw, data = chain["raw"].metadata, chain["data"].metadata
    assert raw["files"] == ["day_0.tsv", "day_1.tsv"] and set(raw["teacher_auc"]) == {"day_0", "day_1"}
    assert chain["files"] == [
        {"name": "day_0.tsv", "index": 0, "split": "train", "valid_fraction": 0.0, "dataset": "criteo"},
        {"name": "day_1.tsv", "index": 1, "split": "valid", "valid_fraction": 0.0, "dataset": "criteo"}]
    assert data["rows"] == {"train": 3000, "valid": 3000}
    assert data["freq_threshold"] == 2
    schema = json.loads(Path(chain["data"].path, "schema.json").read_text())
    assert data["cardinalities"] == schema["cardinalities"] and len(data["cardinalities"]) == 26


def test_train_evaluate_export_report_model_and_auc(chain):
    assert chain["checkpoint"].metadata["steps"] == 4 and chain["checkpoint"].metadata["model"] == "dlrm"
    assert chain["checkpoint"].metadata["best_valid_auc"] >= chain["checkpoint"].metadata["valid_auc"]
    auc = chain["metrics"].metadata["auc"]
    saved = json.loads(Path(chain["report"].path, "metrics.json").read_text())
    assert auc == saved["auc"] and 0.0 <= auc <= 1.0 and chain["metrics"].metadata["rows"] == 3000
    assert auc == pytest.approx(chain["checkpoint"].metadata["best_valid_auc"], abs=1e-6)  # evaluate read the best
    repo = chain["repository"]
    assert repo.metadata["name"] == "tiny" and repo.metadata["max_abs_diff"] <= 1e-5
    assert Path(repo.path, "tiny", "config.pbtxt").exists()


def test_raw_data_copies_given_files_and_fan_out_equals_one_process(chain, tmp_path):
    source = Path(chain["raw"].path)
    raw = artifact(dsl.Dataset, tmp_path, "raw")
    files = components.raw_data.python_func(source=str(source), train_files="day_*.tsv", valid_files="",
                                            raw=raw, valid_fraction=0.25)
    assert sorted(p.name for p in Path(raw.path).iterdir()) == ["day_0.tsv", "day_1.tsv"]  # not synth.json
    assert [(f["split"], f["valid_fraction"]) for f in files] == [("train", 0.25), ("train", 0.25)]
    data = Path(fan_out(tmp_path, raw, files).path)
    single = tmp_path / "single"
    preprocess(sorted(Path(raw.path).glob("day_*.tsv")), out=single, freq_threshold=2, valid_fraction=0.25, workers=1)
    for split in ("train", "valid"):
        names = sorted(p.name for p in (single / split).glob("*.parquet"))
        assert names and sorted(p.name for p in (data / split).glob("*.parquet")) == names
        assert all(pq.read_table(data / split / n).equals(pq.read_table(single / split / n)) for n in names)
    mine, reference = Schema.load(data), Schema.load(single)
    assert (mine.vocab_hash, mine.cardinalities, mine.rows) == (reference.vocab_hash, reference.cardinalities,
                                                                reference.rows)


@pytest.fixture(scope="module")
def movielens_chain(tmp_path_factory) -> dict:
    """The same chain on synthetic movielens-like data: its description travels with the files."""
    tmp = tmp_path_factory.mktemp("components-movielens")
    out = {"raw": artifact(dsl.Dataset, tmp, "raw"), "checkpoint": artifact(dsl.Model, tmp, "checkpoint"),
           "metrics": artifact(dsl.Metrics, tmp, "metrics"), "report": artifact(dsl.Artifact, tmp, "report"),
           "repository": artifact(dsl.Model, tmp, "repository")}
    out["files"] = components.raw_data.python_func(source="", train_files="day_0.*", valid_files="day_1.*",
                                                   raw=out["raw"], synth_rows=2000, synth_days=2, seed=1,
                                                   dataset="movielens-like")
    out["data"] = fan_out(tmp, out["raw"], out["files"], freq_threshold=0)
    components.train.python_func(data=out["data"], checkpoint=out["checkpoint"], batch_size=256,
                                 embedding_dim=4, max_steps=4, **OFF)
    components.evaluate.python_func(data=out["data"], checkpoint=out["checkpoint"], metrics=out["metrics"],
                                    report=out["report"], **OFF)
    components.export.python_func(data=out["data"], checkpoint=out["checkpoint"], report=out["report"],
                                  repository=out["repository"], name="movies", backend="python", **OFF)
    return out


def test_movielens_chain_reads_the_synthesized_description(movielens_chain):
    files = movielens_chain["files"]
    assert [(f["name"], f["split"], f["dataset"]) for f in files] == [
        ("day_0.csv", "train", "movielens.yaml"), ("day_1.csv", "valid", "movielens.yaml")]
    assert movielens_chain["raw"].metadata["dataset"] == "movielens.yaml"
    schema = Schema.load(movielens_chain["data"].path)
    assert [(f.name, f.kind) for f in schema.features.sparse] == [
        ("userId", "categorical"), ("movieId", "categorical"), ("genres", "multi_hot")]
    assert schema.rows == {"train": 2000, "valid": 2000} and schema.freq_threshold == 2  # the description's
    assert 0.0 <= movielens_chain["metrics"].metadata["auc"] <= 1.0
    repo = Path(movielens_chain["repository"].path)
    assert movielens_chain["repository"].metadata["max_abs_diff"] <= 1e-5
    assert 'key: "genres"' in (repo / "movies" / "config.pbtxt").read_text()


def test_raw_data_copies_a_named_description_and_refuses_a_missing_one(tmp_path):
    synthetic = artifact(dsl.Dataset, tmp_path, "synthetic")
    components.raw_data.python_func(source="", train_files="day_0.*", valid_files="day_1.*", raw=synthetic,
                                    synth_rows=300, synth_days=2, dataset="movielens-like")
    source = Path(synthetic.path)
    (source / "synth.json").unlink()  # a user's folder: days and their description
    raw = artifact(dsl.Dataset, tmp_path, "raw")
    files = components.raw_data.python_func(source=str(source), train_files="day_*", valid_files="",
                                            raw=raw, valid_fraction=0.1, dataset="movielens.yaml")
    assert sorted(p.name for p in Path(raw.path).iterdir()) == ["day_0.csv", "day_1.csv", "movielens.yaml"]
    assert {f["dataset"] for f in files} == {"movielens.yaml"} and len(files) == 2
    with pytest.raises(RuntimeError, match="no dataset description 'movies.yaml'"):
        components.raw_data.python_func(source=str(source), train_files="day_*", valid_files="",
                                        raw=artifact(dsl.Dataset, tmp_path, "raw2"), dataset="movies.yaml")


def test_raw_data_names_a_missing_source_or_pattern(tmp_path):
    with pytest.raises(RuntimeError, match="raw data .*nowhere"):
        components.raw_data.python_func(source=str(tmp_path / "nowhere"), train_files="*.tsv", valid_files="",
                                        raw=artifact(dsl.Dataset, tmp_path, "raw"))
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "a.tsv").write_text("")
    with pytest.raises(RuntimeError, match=r"day_9.tsv\*: no file matches"):
        components.raw_data.python_func(source=str(tmp_path / "given"), train_files="a.tsv",
                                        valid_files="day_9.tsv*", raw=artifact(dsl.Dataset, tmp_path, "raw2"))


def test_failed_step_raises_with_its_command(tmp_path):
    raw = artifact(dsl.Dataset, tmp_path, "raw")
    Path(raw.path).mkdir()
    Path(raw.path, "day_0.tsv").write_text("1\t2\n")  # 2 fields instead of 40
    file = {"name": "day_0.tsv", "index": 0, "split": "train", "valid_fraction": 0.0}
    with pytest.raises(RuntimeError, match="ctrflow preprocess count"):
        components.count_values.python_func(raw=raw, file=file, counts=artifact(dsl.Artifact, tmp_path, "counts"))


def test_track_data_logs_synth_and_preprocess_child_runs(chain, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from ctrflow.tracking import start_pipeline_run

    parent = start_pipeline_run(uri, "t", "pipeline", "kfp-1", {"seed": 1})
    components.track_data.python_func(raw=chain["raw"], data=chain["data"], tracking_uri=uri, experiment="t",
                                      parent_run_id=parent, kfp_run_id="kfp-1")
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id],
                              f"tags.`mlflow.parentRunId` = '{parent}'")
    by_step = {r.data.tags["ctrflow.step"]: r for r in runs}
    assert set(by_step) == {"synth", "preprocess"}
    assert by_step["preprocess"].data.metrics["rows_train"] == 3000
    assert by_step["preprocess"].data.tags["vocab_hash"] == chain["data"].metadata["vocab_hash"]
    assert by_step["synth"].data.metrics["teacher_auc_day_1"] == chain["raw"].metadata["teacher_auc"]["day_1"]
    assert all(r.data.tags["kfp.run_id"] == "kfp-1" for r in runs)
    # each run spans the time its step ran, not the moment it was logged: synth before preprocess
    synth, preprocess = by_step["synth"].info, by_step["preprocess"].info
    stats = json.loads(Path(chain["data"].path, "stats.json").read_text())
    assert synth.start_time <= synth.end_time <= preprocess.start_time < preprocess.end_time
    assert preprocess.end_time - preprocess.start_time == pytest.approx(stats["passes"]["total_seconds"] * 1000, abs=2)


def test_the_daily_preprocessing_grows_the_previous_vocabularies(tmp_path):
    """`preprocess_day` on two days' files of `raw_data`: the second against the first's output, with
    a quarter of each day held out; an empty state gives the first day no inputs."""
    days = [artifact(dsl.Dataset, tmp_path, f"raw{k}") for k in range(2)]
    source = tmp_path / "logs"
    components.raw_data.python_func(source="", train_files="day_*", valid_files="", raw=days[0], synth_rows=1500,
                                    synth_days=2, seed=2)
    Path(days[0].path).rename(source)
    first = components.day_inputs.python_func(state=str(tmp_path / "state"), day_files="day_0.*")
    assert (first.day_files, first.vocab_from, first.init_from, first.base) == ("day_0.*", "", "", "")
    data = [artifact(dsl.Dataset, tmp_path, f"data{k}") for k in range(2)]
    for k in range(2):
        files = components.raw_data.python_func(source=str(source), train_files=f"day_{k}.*", valid_files="",
                                                raw=days[k], valid_fraction=0.25)
        components.preprocess_day.python_func(raw=days[k], files=files, data=data[k],
                                              vocab_from=data[0].path if k else "", freq_threshold=2)
    before, after = Schema.load(data[0].path), Schema.load(data[1].path)
    assert before.parent is None and after.parent["vocab_hash"] == before.vocab_hash
    assert data[1].metadata["parent"] == before.vocab_hash
    assert all(after.cardinalities[k] >= n for k, n in before.cardinalities.items())
    assert 250 <= after.rows["valid"] <= 500 and after.rows["train"] + after.rows["valid"] == 1500
