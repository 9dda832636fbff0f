"""Exact metrics and the evaluate step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ctrflow.evaluate import compute_metrics
from ctrflow.metrics import auc, calibration, logloss, roc_curve
from ctrflow.contract.features import Features


def _pairwise_auc(labels, scores):
    """O(n^2) definition: P(score_pos > score_neg) + 0.5 P(tie)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size


def test_auc_matches_pairwise_definition_with_ties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 3000).astype(np.float32)
    scores = np.round(rng.normal(size=3000) + labels, 1)  # rounding makes many ties
    assert auc(labels, scores) == pytest.approx(_pairwise_auc(labels, scores), abs=1e-12)


def test_auc_extremes_and_single_class():
    labels = np.array([0, 0, 1, 1])
    assert auc(labels, [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert auc(labels, [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert auc(labels, [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert np.isnan(auc([1, 1], [0.2, 0.3]))
    with pytest.raises(ValueError):
        auc([0, 2], [0.1, 0.2])


def test_roc_curve_area_equals_auc():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 500)
    scores = np.round(rng.normal(size=500) + labels, 1)
    fpr, tpr = roc_curve(labels, scores)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
    assert np.trapezoid(tpr, fpr) == pytest.approx(auc(labels, scores), abs=1e-12)


def test_logloss_is_mean_cross_entropy_and_finite_at_certainty():
    assert logloss([1, 0], [0.8, 0.3]) == pytest.approx(-(np.log(0.8) + np.log(0.7)) / 2)
    assert np.isfinite(logloss([1, 0], [0.0, 1.0]))


def test_calibration_table_accounts_for_every_row():
    rng = np.random.default_rng(2)
    probs = rng.uniform(0.05, 0.6, 1001)
    labels = (rng.uniform(size=1001) < probs).astype(np.float64)
    table = calibration(labels, probs, bins=10)
    assert sum(b["rows"] for b in table["bins"]) == 1001
    assert table["mean_prediction"] == pytest.approx(probs.mean())
    assert table["observed_ctr"] == pytest.approx(labels.mean())
    means = [b["mean_prediction"] for b in table["bins"]]
    assert means == sorted(means)
    assert table["ece"] < 0.08  # labels drawn from the probabilities: nearly calibrated


def test_compute_metrics_keys_and_values():
    labels = np.array([0, 1, 0, 1, 1], dtype=np.float32)
    logits = np.array([-2.0, 1.0, 0.5, 3.0, -0.5], dtype=np.float32)
    m = compute_metrics(labels, logits)
    assert m["rows"] == 5 and m["positives"] == 3
    assert m["auc"] == pytest.approx(_pairwise_auc(labels, logits))
    assert m["observed_ctr"] == pytest.approx(0.6)
    assert m["mean_prediction"] == pytest.approx(np.mean(1 / (1 + np.exp(-logits.astype(np.float64)))))


def test_evaluate_cli_writes_metrics_and_plots(tmp_path, tmp_path_factory, capsys):
    from tests.fixtures.serving import checkpoint, processed_data

    from ctrflow.cli import main
    from ctrflow.loaders.memory import ParquetDataset
    from ctrflow.predict import score_logits
    from ctrflow.checkpoint import load_model

    _, data = processed_data(tmp_path_factory)
    ckpt = checkpoint(tmp_path_factory)
    out = tmp_path / "eval"
    assert main(["evaluate", "--data", str(data), "--checkpoint", str(ckpt), "--out", str(out),
                 "--batch-size", "128"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    valid = ParquetDataset(data, "valid")
    logits = score_logits(load_model(ckpt)[0], valid.dense, valid.sparse)
    assert metrics["rows"] == len(valid) == 600
    assert metrics["auc"] == pytest.approx(auc(valid.labels, logits), abs=1e-12)
    assert metrics["observed_ctr"] == pytest.approx(valid.labels.mean())
    assert set(metrics) >= {"auc", "logloss", "rows", "mean_prediction", "observed_ctr", "calibration"}
    for png in ("roc.png", "calibration.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 600


def test_evaluate_refuses_checkpoint_of_other_data(tmp_path, tmp_path_factory, capsys):
    import shutil

    from tests.fixtures.serving import checkpoint, processed_data

    from ctrflow.cli import main
    from ctrflow.contract.criteo import criteo_features
    from ctrflow.contract.schema import Schema

    _, data = processed_data(tmp_path_factory)
    other = tmp_path / "other"
    shutil.copytree(data, other)
    schema = Schema.load(other)
    cards = dict(schema.cardinalities, C7=schema.cardinalities["C7"] + 1)
    Schema(cardinalities=cards, features=criteo_features(cards), freq_threshold=2,
           rows=schema.rows, vocab_hash=schema.vocab_hash).save(other / "schema.json")
    code = main(["evaluate", "--data", str(other), "--checkpoint", str(checkpoint(tmp_path_factory)),
                 "--out", str(tmp_path / "eval")])
    assert code == 2
    assert "C7 cardinality" in capsys.readouterr().err


# --- validation streamed in order (ctrflow.loaders.scan) vs the split read whole ---------------------------------


def _model():
    from ctrflow.models import build_model

    return build_model("dlrm", Features.categorical([20] * 26, 13), 8, seed=3).eval()


def _in_memory_metrics(data):
    """Today's reference: the whole valid split in memory, scored in order, metrics on every row."""
    import torch

    from ctrflow.loaders.memory import BatchLoader, ParquetDataset

    loader = BatchLoader(ParquetDataset(data, "valid", [20] * 26), 64, shuffle=False, drop_last=False, prefetch=0)
    with torch.no_grad():
        logits = torch.cat([_model()(b.dense, b.sparse) for b in loader.batches()]).numpy()
    labels = loader.dataset.labels
    return {"auc": auc(labels, logits), "logloss": logloss(labels, 1 / (1 + np.exp(-logits.astype(np.float64)))),
            "rows": len(labels)}


def _validate_share(rank, world, data, store, results, fused_sharded=False):
    """One process of `world`: validate its share; every rank's result is returned. `fused_sharded`:
    the tables sharded table-wise in a fused collection (its all-to-alls need equal batch sizes)."""
    import torch
    import torch.distributed as dist

    from ctrflow.loaders.scan import ScanLoader
    from ctrflow.loaders.stream_plan import ParquetIndex
    from ctrflow.runtime import Runtime
    from ctrflow.train.validate import validate

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        loader = ScanLoader(ParquetIndex(data, "valid"), 64, rank=rank, world_size=world, table_sizes=[20] * 26,
                            window_rows=96, threads=1)
        model = _model().train()
        if fused_sharded:
            from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
            from ctrflow.embedding.plan import plan_sharding

            tables = model.embeddings.tables
            model.embeddings = FusedShardedEmbeddingCollection.from_collection(
                model.embeddings, plan_sharding(tables, world, "table"), optimizer="sgd", lr=0.1)
        results[rank] = validate(model, loader, Runtime(rank, world, rank, torch.device("cpu")))
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def valid_dir(tmp_path_factory):
    from tests.fixtures.training import write_processed

    return write_processed(tmp_path_factory.mktemp("valid"), train_rows=10, valid_rows=701, cardinality=20, parts=3)


def test_streamed_validation_equals_the_in_memory_metrics(valid_dir):
    results = {}
    _validate_share(0, 1, valid_dir, None, results)
    expected = _in_memory_metrics(valid_dir)
    assert results[0]["rows"] == expected["rows"] == 701
    assert results[0]["auc"] == pytest.approx(expected["auc"], abs=1e-12)
    assert results[0]["logloss"] == pytest.approx(expected["logloss"], rel=1e-9)


@pytest.mark.parametrize("fused_sharded", [False, True], ids=["replicated", "fused-sharded"])
def test_two_processes_validate_exactly_the_whole_split(valid_dir, tmp_path, fused_sharded):
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    results = ctx.Manager().dict()
    # 701 rows: shares of 350 and 351 rows, so the last batches differ in size between the processes
    procs = [ctx.Process(target=_validate_share, args=(r, 2, valid_dir, tmp_path / "store", results, fused_sharded))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    expected = _in_memory_metrics(valid_dir)
    assert results[0] == results[1]  # every process gets the same numbers
    assert results[0]["rows"] == 701  # each row scored once, by one process
    assert results[0]["auc"] == pytest.approx(expected["auc"], abs=1e-12)
    assert results[0]["logloss"] == pytest.approx(expected["logloss"], rel=1e-9)
