"""Calibration on rare clicks: the metrics, `ctrflow synth --click-rate`, and the output bias each kept
checkpoint holds (fitted on the validation split)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ctrflow.cli import main
from ctrflow.evaluate import compute_metrics
from ctrflow.metrics import calibrating_shift, calibration


def test_ratio_and_ece_match_a_hand_computed_case():
    labels = np.array([0, 0, 1, 1])
    probs = np.array([0.1, 0.3, 0.6, 0.8])
    table = calibration(labels, probs, bins=2)
    # bins {0.1, 0.3}: predicted 0.2, observed 0; {0.6, 0.8}: predicted 0.7, observed 1
    assert [b["mean_prediction"] for b in table["bins"]] == pytest.approx([0.2, 0.7])
    assert [b["observed_ctr"] for b in table["bins"]] == [0.0, 1.0]
    assert table["ece"] == pytest.approx(0.5 * 0.2 + 0.5 * 0.3)
    assert table["ratio"] == pytest.approx(0.45 / 0.5)
    metrics = compute_metrics(labels, np.log(probs / (1 - probs)), bins=2)
    assert metrics["calibration_ratio"] == pytest.approx(0.9) and metrics["ece"] == pytest.approx(0.25)


def test_the_shift_makes_the_mean_prediction_the_observed_rate_and_keeps_the_ranking():
    rng = np.random.default_rng(0)
    logits = rng.normal(-3.0, 1.5, 200_000)
    labels = (rng.random(logits.size) < 1 / (1 + np.exp(-(logits - 0.4)))).astype(np.float64)  # 1.4x too high
    shift = calibrating_shift(labels, logits)
    assert shift == pytest.approx(-0.4, abs=0.03)
    moved = compute_metrics(labels, logits + shift)
    assert moved["calibration_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert moved["auc"] == compute_metrics(labels, logits)["auc"]
    # fitted on one half, the other half is calibrated too: one number from many rows
    half = logits.size // 2
    other = compute_metrics(labels[half:], logits[half:] + calibrating_shift(labels[:half], logits[:half]))
    assert 0.97 < other["calibration_ratio"] < 1.03
    assert calibrating_shift(np.zeros(4), logits[:4]) == 0.0  # one class: nothing to fit


@pytest.mark.parametrize("dataset, name", [("criteo", "day_0.tsv"), ("movielens-like", "day_0.csv")])
def test_synth_click_rate_lands_near_the_rate_asked(tmp_path, capsys, dataset, name):
    out = tmp_path / dataset
    assert main(["synth", "--dataset", dataset, "--rows", "20000", "--days", "1", "--click-rate", "0.04",
                 "--out", str(out), "--tracking-uri", "none"]) == 0
    report = json.loads((out / "synth.json").read_text())
    assert report["ctr"]["day_0"] == pytest.approx(0.04, abs=0.006)  # 20,000 rows: sd 0.0014
    assert report["params"]["teacher"]["target_ctr"] == 0.04
    assert 0.76 < report["teacher_auc"]["day_0"] < 0.84  # the teacher still ranks as well
    assert main(["synth", "--dataset", dataset, "--rows", "10", "--click-rate", "1.5", "--out",
                 str(tmp_path / "bad"), "--tracking-uri", "none"]) == 2
    assert "--click-rate must be between 0 and 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def rare_clicks(tmp_path_factory):
    """20,000 Criteo-like rows a day at a 4 % click rate, preprocessed: day 0 trains, day 1 validates."""
    root = tmp_path_factory.mktemp("rare")
    main(["synth", "--rows", "20000", "--days", "2", "--click-rate", "0.04", "--out", str(root / "raw"),
          "--tracking-uri", "none"])
    main(["preprocess", "--train", str(root / "raw" / "day_0.tsv"), "--valid", str(root / "raw" / "day_1.tsv"),
          "--out", str(root / "data"), "--workers", "1", "--no-progress", "--tracking-uri", "none"])
    return root / "data"


def train_and_evaluate(data, out, *flags: str) -> tuple[dict, dict]:
    """(evaluate's metrics.json, the kept checkpoint's meta.json) of one epoch of DLRM."""
    assert main(["train", "--data", str(data), "--out", str(out / "ckpt"), "--batch-size", "512", "--threads", "1",
                 "--no-progress", "--tracking-uri", "none", *flags]) == 0
    assert main(["evaluate", "--data", str(data), "--checkpoint", str(out / "ckpt"), "--out", str(out / "eval"),
                 "--device", "cpu", "--tracking-uri", "none"]) == 0
    best = (out / "ckpt" / "best").read_text().strip()
    return (json.loads((out / "eval" / "metrics.json").read_text()),
            json.loads((out / "ckpt" / best / "meta.json").read_text()))


def test_the_kept_checkpoint_holds_the_bias_fitted_on_the_validation_split(rare_clicks, tmp_path):
    metrics, meta = train_and_evaluate(rare_clicks, tmp_path / "calibrated")
    raw, raw_meta = train_and_evaluate(rare_clicks, tmp_path / "raw", "--no-calibrate")
    record = meta["calibration"]
    assert raw_meta.get("calibration") is None and metrics["checkpoint_calibration"] == record
    # the same training either way: the calibrated checkpoint differs by its output bias alone
    assert record["calibration_ratio_before"] == pytest.approx(raw["calibration_ratio"], rel=1e-4)
    assert abs(raw["calibration_ratio"] - 1.0) > 0.05  # what there was to fix
    assert metrics["calibration_ratio"] == pytest.approx(1.0, abs=0.01)
    assert metrics["auc"] == pytest.approx(raw["auc"], abs=1e-6) and metrics["logloss"] < raw["logloss"]
