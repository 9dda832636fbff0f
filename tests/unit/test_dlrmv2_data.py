"""MLPerf DLRMv2's data at small scale on the CPU: the seeded multi-hot expansion (`ctrflow multihot`), and
`ctrflow synth --dataset dlrmv2` -> preprocess -> train --config mlperf-dlrmv2 -> evaluate."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from ctrflow.cli import main
from ctrflow.contract.multihot import HOTNESS, expand
from ctrflow.contract.schema import Schema

SMALL_DCN = ["--embedding-dim", "16", "--bottom-mlp", "32,16", "--deep-mlp", "32,16", "--cross-rank", "8"]


def test_expansion_keeps_the_value_first_and_draws_the_rest_from_the_value_alone():
    values = np.array([5, 9, 5, 0, 123456789])
    bags = expand(values, 6, 2, 1000, key=17)
    assert bags.shape == (5, 6) and np.array_equal(bags[:, 0], values)
    assert np.array_equal(bags[0], bags[2]) and not np.array_equal(bags[0], bags[1])  # equal values, equal bags
    assert ((bags[:, 1:] >= 2) & (bags[:, 1:] < 1000)).all()
    assert not np.array_equal(expand(values, 6, 2, 1000, key=18)[:, 1:], bags[:, 1:])  # another seed, other bags
    many = expand(np.arange(20000), 2, 2, 50, key=3)[:, 1]
    assert len(np.unique(many)) == 48 and np.bincount(many)[2:].min() > 300  # uniform over [2, 50)


@pytest.fixture(scope="module")
def one_hot(tmp_path_factory):
    """A small preprocessed one-hot Criteo dataset."""
    root = tmp_path_factory.mktemp("onehot")
    assert main(["synth", "--rows", "1500", "--days", "2", "--out", str(root / "raw")]) == 0
    assert main(["preprocess", "--train", str(root / "raw/day_0.tsv"), "--valid", str(root / "raw/day_1.tsv"),
                 "--out", str(root / "data"), "--freq-threshold", "2"]) == 0
    return root


def test_multihot_expands_a_preprocessed_dataset(one_hot, capsys):
    out = one_hot / "mh"
    assert main(["multihot", "--data", str(one_hot / "data"), "--out", str(out), "--seed", "4"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["rows"] == 3000 and report["ids_per_row"] == 214
    before, after = Schema.load(one_hot / "data"), Schema.load(out)
    assert after.features.slots == 214 and after.vocab_hash == before.vocab_hash and after.rows == before.rows
    assert [f.max_length for f in after.features.sparse] == list(HOTNESS)
    assert after.dataset["multihot"] == {"sizes": list(HOTNESS), "seed": 4, "from": str(one_hot / "data")}
    old, new = pq.read_table(one_hot / "data/valid/part-00000.parquet"), pq.read_table(out / "valid/part-00000.parquet")
    bags = np.array(new["C21"].to_pylist())  # 100 ids a row
    assert bags.shape == (1500, 100) and np.array_equal(bags[:, 0], old["C21"].to_numpy())
    card = after.cardinalities["C21"]
    assert ((bags[:, 1:] >= 2) & (bags[:, 1:] < card)).all()
    assert np.array_equal(new["C3"].to_numpy(), old["C3"].to_numpy()) and new["label"].equals(old["label"])


def test_multihot_refuses_sizes_that_do_not_match_the_features(one_hot, capsys):
    assert main(["multihot", "--data", str(one_hot / "data"), "--out", str(one_hot / "bad"), "--sizes", "2,3"]) == 2
    assert "--sizes: need 26 sizes" in capsys.readouterr().err and not (one_hot / "bad").exists()


def test_dlrmv2_shape_runs_synth_preprocess_train_evaluate(tmp_path, capsys):
    raw, data, ckpt = tmp_path / "raw", tmp_path / "data", tmp_path / "ckpt"
    assert main(["synth", "--dataset", "dlrmv2", "--rows", "2000", "--days", "2", "--out", str(raw)]) == 0
    first = (raw / "day_0.tsv").read_text().splitlines()[0].split("\t")
    assert len(first[14 + 20].split("|")) in (0, 100) and first[14 + 2].count("|") == 0  # C21: 100 ids; C3: one
    assert main(["preprocess", "--dataset", str(raw / "dlrmv2.yaml"), "--train", str(raw / "day_0.tsv"),
                 "--valid", str(raw / "day_1.tsv"), "--out", str(data)]) == 0
    assert Schema.load(data).features.slots == 214
    assert main(["train", "--config", "mlperf-dlrmv2", "--data", str(data), "--out", str(ckpt), "--batch-size", "256",
                 "--eval-batch-size", "2000", *SMALL_DCN, "--tracking-uri", "none"]) == 0
    assert main(["evaluate", "--data", str(data), "--checkpoint", str(ckpt), "--out", str(tmp_path / "eval"),
                 "--tracking-uri", "none"]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    config = json.loads((ckpt / "config.json").read_text())
    assert config["resolved"]["model"]["name"] == "dcnv2" and config["resolved"]["optim"]["sparse"] == "adagrad"
    assert metrics["auc"] > 0.6  # the teacher's signal, learned from 8 steps of 256 rows
