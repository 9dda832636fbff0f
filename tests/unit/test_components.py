"""Each component's body on tiny real data (`component.python_func` with artifacts in temp dirs):
it drives the step's CLI and describes its outputs in artifact metadata."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("kfp")

from kfp import dsl  # noqa: E402

import components  # noqa: E402


def artifact(kind, folder: Path, name: str):
    return kind(name=name, uri=str(folder / name), metadata={})


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """synth -> preprocess -> train -> evaluate -> export, each as its component's Python body."""
    off = {"tracking_uri": "none"}  # module fixtures run before conftest's per-test tracking switch
    tmp = tmp_path_factory.mktemp("components")
    out = {"raw": artifact(dsl.Dataset, tmp, "raw"), "data": artifact(dsl.Dataset, tmp, "data"),
           "checkpoint": artifact(dsl.Model, tmp, "checkpoint"), "metrics": artifact(dsl.Metrics, tmp, "metrics"),
           "report": artifact(dsl.Artifact, tmp, "report"), "repository": artifact(dsl.Model, tmp, "repository")}
    components.synth.python_func(rows=3000, days=2, seed=1, raw=out["raw"], **off)
    components.preprocess.python_func(raw=out["raw"], train_files="day_0.tsv*", valid_files=" day_1.tsv* ",
                                      data=out["data"], freq_threshold=2, **off)
    components.train.python_func(data=out["data"], checkpoint=out["checkpoint"], batch_size=512,
                                 embedding_dim=4, max_steps=4, **off)
    components.evaluate.python_func(data=out["data"], checkpoint=out["checkpoint"], metrics=out["metrics"],
                                    report=out["report"], **off)
    components.export.python_func(data=out["data"], checkpoint=out["checkpoint"], repository=out["repository"],
                                  name="tiny", **off)
    return out


def test_synth_and_preprocess_describe_their_data(chain):
    raw, data = chain["raw"].metadata, chain["data"].metadata
    assert raw["files"] == ["day_0.tsv", "day_1.tsv"] and set(raw["teacher_auc"]) == {"day_0", "day_1"}
    assert data["rows"] == {"train": 3000, "valid": 3000}
    assert data["freq_threshold"] == 2
    schema = json.loads(Path(chain["data"].path, "schema.json").read_text())
    assert data["cardinalities"] == schema["cardinalities"] and len(data["cardinalities"]) == 26


def test_train_evaluate_export_report_model_and_auc(chain):
    assert chain["checkpoint"].metadata["steps"] == 4 and chain["checkpoint"].metadata["model"] == "dlrm"
    auc = chain["metrics"].metadata["auc"]
    saved = json.loads(Path(chain["report"].path, "metrics.json").read_text())
    assert auc == saved["auc"] and 0.0 <= auc <= 1.0 and chain["metrics"].metadata["rows"] == 3000
    repo = chain["repository"]
    assert repo.metadata["name"] == "tiny" and repo.metadata["max_abs_diff"] <= 1e-5
    assert Path(repo.path, "tiny", "config.pbtxt").exists()


def test_failed_step_raises_with_its_command(tmp_path):
    raw = artifact(dsl.Dataset, tmp_path, "raw")
    Path(raw.path).mkdir()
    Path(raw.path, "day_0.tsv").write_text("1\t2\n")  # 2 fields instead of 40
    with pytest.raises(RuntimeError, match="ctrflow preprocess"):
        components.preprocess.python_func(raw=raw, train_files="day_0.tsv", valid_files="",
                                          data=artifact(dsl.Dataset, tmp_path, "data"))
