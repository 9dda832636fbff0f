"""Training on any feature set through the real entry points: multi-hot bags, no dense features, no
sparse features; fused == plain with bags; checkpoints, evaluation and scoring of such models; the
output bias a fresh run starts from."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ctrflow.checkpoint import load_model, read_meta, resolve_checkpoint
from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.evaluate import evaluate
from ctrflow.loaders.memory import ParquetDataset
from ctrflow.predict import score, score_logits
from ctrflow.contract.schema import Schema
from ctrflow.train.loop import train
from tests.fixtures.multihot import mixed_features, write_mixed

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    return write_mixed(tmp_path_factory.mktemp("mixed"), mixed_features(2, 2, 2), train_rows=2048, valid_rows=512)


# fast rates for a few steps on two thousand rows, without the embedding L2 (with it DLRM validates at 0.64:
# its tables stay small this early)
TOY_RATES = OptimConfig(lr=3e-3, sparse_lr=0.05, embedding_l2=0.0)


def config(data, out, model="dlrm", **kw) -> TrainConfig:
    return TrainConfig(out=str(out), data=DataConfig(path=str(data), batch_size=256, prefetch=2),
                       model=ModelConfig(name=model, embedding_dim=16), progress=False, log_every=1,
                       deterministic=True, **kw)


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("model", ["dlrm", "wide_deep"])
def test_a_multi_hot_model_trains_and_its_checkpoint_scores_the_same(mixed_dir, tmp_path, model):
    out = tmp_path / model
    summary = train(config(mixed_dir, out, model, epochs=2, optim=TOY_RATES))
    assert summary["valid_auc"] > 0.65  # the bags carry most of the signal
    loaded, schema, _ = load_model(out)  # evaluate/export's reader: a plain CPU model from schema.json
    assert schema.features == Schema.load(mixed_dir).features
    metrics = evaluate(mixed_dir, out, tmp_path / "eval", batch_size=100)
    assert metrics["rows"] == 512 and metrics["auc"] == pytest.approx(summary["best_valid_auc"], abs=1e-6)
    valid = ParquetDataset(mixed_dir, "valid")
    logits = score_logits(loaded, valid.dense, valid.sparse, batch_size=128)
    probs = score(loaded, valid.dense, valid.sparse)
    np.testing.assert_allclose(probs, 1 / (1 + np.exp(-logits.astype(np.float64))), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparse", ["sgd", "adagrad", "lazy_adam"])
def test_fused_bags_train_as_the_plain_collection(mixed_dir, tmp_path, sparse):
    optim = OptimConfig(sparse=sparse, sparse_lr=0.05)
    plain = train(config(mixed_dir, tmp_path / "plain", max_steps=6, optim=optim, embedding="plain"))
    fused = train(config(mixed_dir, tmp_path / "fused", max_steps=6, optim=optim, embedding="fused"))
    expected, got = losses(tmp_path / "plain"), losses(tmp_path / "fused")
    assert sorted(got) == list(range(1, 7))
    # the fused Adam is SparseAdam's rule (eps added to sqrt(v) before the bias correction), the plain
    # lazy_adam adds it after: they part by ~1e-4 in six steps, one-hot tables alike
    rel = 1e-3 if sparse == "lazy_adam" else 1e-4
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=rel, abs=1e-5), step
    assert fused["valid_auc"] == pytest.approx(plain["valid_auc"], abs=1e-2 if sparse == "lazy_adam" else 1e-4)


@pytest.mark.parametrize("shape", [(0, 1, 2), (3, 0, 0)], ids=["no_dense", "no_sparse"])
@pytest.mark.parametrize("model", ["dlrm", "dcnv2", "deepfm", "wide_deep"])
def test_every_model_trains_without_dense_or_without_sparse_features(tmp_path, model, shape):
    data = write_mixed(tmp_path / "data", mixed_features(*shape), train_rows=1024, valid_rows=256)
    # the default embedding L2: a DLRM without dense features trains without it (`build._resolved_optim`)
    summary = train(config(data, tmp_path / "out", model, epochs=2, optim=OptimConfig(lr=3e-3, sparse_lr=0.05)))
    assert summary["valid_auc"] > 0.6, summary
    loaded, _, _ = load_model(tmp_path / "out")
    if model == "dlrm" and shape[0] == 0:
        assert loaded.dense_arch is None


def test_a_fresh_run_starts_at_the_click_rate_and_a_resumed_one_keeps_its_bias(mixed_dir, tmp_path):
    rate = Schema.load(mixed_dir).label_rate
    frozen = OptimConfig(lr=0.0, sparse_lr=0.0)  # nothing moves: the checkpoint holds the starting weights
    train(config(mixed_dir, tmp_path / "start", "deepfm", max_steps=1, optim=frozen, calibrate=False))
    dense = torch.load(resolve_checkpoint(tmp_path / "start") / "dense.pt", weights_only=True)
    out_bias = [k for k in dense if k.startswith("over_arch.") and k.endswith(".bias")][-1]
    assert float(dense[out_bias][0]) == pytest.approx(math.log(rate / (1 - rate)), abs=1e-6)
    assert float(dense["linear_dense.bias"][0]) == 0.0
    # resuming restores the trained bias instead of starting it again: the same trajectory as one run
    train(config(mixed_dir, tmp_path / "straight", "deepfm", max_steps=6, epochs=2))
    train(config(mixed_dir, tmp_path / "first", "deepfm", max_steps=3, epochs=2))
    train(config(mixed_dir, tmp_path / "resumed", "deepfm", max_steps=6, epochs=2, resume=str(tmp_path / "first")))
    expected, got = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert all(got[s] == pytest.approx(expected[s], rel=1e-5) for s in range(4, 7))
    assert read_meta(resolve_checkpoint(tmp_path / "resumed"))["step"] == 6


def test_a_dlrm_without_dense_features_trains_its_embeddings_without_the_l2(tmp_path):
    data = write_mixed(tmp_path / "data", mixed_features(0, 1, 2), train_rows=1024, valid_rows=256)
    train(config(data, tmp_path / "dlrm", "dlrm", max_steps=2))
    train(config(data, tmp_path / "deepfm", "deepfm", max_steps=2))
    resolved = {m: json.loads((tmp_path / m / "config.json").read_text())["resolved"]["optim"]["embedding_l2"]
                for m in ("dlrm", "deepfm")}
    assert resolved == {"dlrm": 0.0, "deepfm": OptimConfig().embedding_l2}
