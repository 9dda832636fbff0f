"""Ranking models past ONNX's 2 GB protobuf limit export with external data (simulated by
lowering the limit: a real one needs gigabytes of tables)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_weights_beyond_protobuf_limit_go_to_external_data(tmp_path, monkeypatch):
    from ctrflow.cli import main
    from ctrflow.synth.criteo import synthesize
    from ctrflow.export import onnx_model

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    monkeypatch.setattr(onnx_model, "PROTOBUF_LIMIT", 0)
    synthesize(tmp_path / "raw", rows=2000, days=2, seed=5)
    steps = [
        ["preprocess", "--train", str(tmp_path / "raw" / "day_0.tsv"), "--valid", str(tmp_path / "raw" / "day_1.tsv"),
         "--out", str(tmp_path / "data"), "--freq-threshold", "2"],
        ["train", "--data", str(tmp_path / "data"), "--model", "dcnv2", "--out", str(tmp_path / "ckpt"),
         "--max-steps", "5", "--batch-size", "128", "--embedding-dim", "4"],
        ["export", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"),
         "--out", str(tmp_path / "repo"), "--name", "big"],
    ]
    for argv in steps:
        assert main(argv) == 0, argv[0]
    version = tmp_path / "repo" / "big_model" / "1"
    # beside the graph and its weights: checkpoint/, the weights the next `export --base` diffs against
    assert sorted(p.name for p in version.iterdir()) == ["checkpoint", "model.onnx", "model.onnx.data"]
    assert (version / "model.onnx.data").stat().st_size > (version / "model.onnx").stat().st_size
    report = json.loads((tmp_path / "repo" / "validation.json").read_text())
    assert report["passed"] and report["max_abs_diff"] <= 1e-5
