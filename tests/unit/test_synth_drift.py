"""`ctrflow synth --drift F`: days whose category values renew (new users, movies, Criteo values appear,
the ones they replace stop) and whose teacher moves; without `--drift` (or with 0) the bytes are what
they always were."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.synth.criteo import synthesize as criteo_synthesize
from ctrflow.synth.drift import Drift
from ctrflow.synth.movielens import ITEMS, USERS, synthesize as movielens_synthesize

# sha256 of the day files of `--rows 3000 --days 2 --seed 5`, as written before `--drift` existed
GOLDEN = {
    "movielens-like": {"day_0.csv": "07c9b20f7dffd525bcecd21f0245966aa4971bc2716cfec969c57855fda59756",
                       "day_1.csv": "41851e6ece1875b226ddb4c5bd0c0bdd6478dd6baa9e3afbd101c42834943e54"},
    "criteo": {"day_0.tsv": "79d94598cd9283b4659fc96c8f52080ee0014161e700b5e6e18a1965e97e2b02",
               "day_1.tsv": "66bffeae962c98e0693261da63d10290ca2f2a1bd2b1bb4f5f678a9b3a50acbb"},
}


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("dataset", sorted(GOLDEN))
def test_no_drift_keeps_the_bytes(tmp_path, dataset):
    for name, flags in (("plain", []), ("zero", ["--drift", "0"])):
        out = tmp_path / name
        assert main(["synth", "--dataset", dataset, "--rows", "3000", "--days", "2", "--seed", "5", "--out", str(out),
                     "--tracking-uri", "none", *flags]) == 0
        assert {f: digest(out / f) for f in GOLDEN[dataset]} == GOLDEN[dataset]
        assert "drift" not in json.loads((out / "synth.json").read_text())


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    movielens_synthesize(root / "plain", rows=20000, days=3, seed=1)
    report = movielens_synthesize(root / "drift", rows=20000, days=3, seed=1, drift=0.2)
    return root, report


def test_movielens_values_renew_and_old_ones_stop(drifting):
    root, report = drifting
    plain = [pd.read_csv(root / "plain" / f"day_{d}.csv") for d in range(3)]
    drift = [pd.read_csv(root / "drift" / f"day_{d}.csv") for d in range(3)]
    assert (root / "drift" / "day_0.csv").read_bytes() == (root / "plain" / "day_0.csv").read_bytes()
    for day in (1, 2):
        for column, universe in (("userId", USERS[0]), ("movieId", ITEMS[0])):
            ids = drift[day][column].to_numpy()
            new = ids > universe  # a renewed slot's value: its day-0 id + generation * universe
            slots = pd.Series(new).groupby((ids - 1) % universe).first()  # per slot seen: renewed or not
            expected = 1 - (1 - 0.2) ** day  # slots are renewed whatever their popularity
            assert len(slots) > 1000 and abs(slots.mean() - expected) < 0.03, (day, column, slots.mean())
            replaced = set((ids[new] - 1) % universe + 1)  # the day-0 ids of the renewed slots ...
            assert not replaced & set(ids[~new])  # ... stopped appearing
            # the rows drew the same slots as without drift: a value is the slot's, renewed or not
            assert np.array_equal((ids - 1) % universe + 1, plain[day][column].to_numpy())
    assert drift[1].liked.to_numpy().mean() == pytest.approx(0.35, abs=0.03)  # the like rate holds
    assert (drift[2].liked != plain[2].liked).mean() > 0.05  # the teacher moved
    assert report["drift"]["share"] == 0.2 and all(0.75 < a < 0.87 for a in report["teacher_auc"].values())
    assert json.loads((root / "drift" / "synth.json").read_text())["drift"]["share"] == 0.2


def test_criteo_values_renew(tmp_path):
    criteo_synthesize(tmp_path / "plain", rows=4000, days=2, seed=2)
    report = criteo_synthesize(tmp_path / "drift", rows=4000, days=2, seed=2, drift=0.3)
    read = [pd.read_csv(tmp_path / name / "day_1.tsv", sep="\t", header=None, dtype=str) for name in ("plain", "drift")]
    day0 = pd.read_csv(tmp_path / "drift" / "day_0.tsv", sep="\t", header=None, dtype=str)
    assert (tmp_path / "drift" / "day_0.tsv").read_bytes() == (tmp_path / "plain" / "day_0.tsv").read_bytes()
    unseen = [(~r[16].dropna().isin(set(day0[16].dropna()))).mean() for r in read]  # C3: 8 hex digits
    assert unseen[1] > unseen[0] + 0.15  # new values on top of the tail's
    assert read[1][16].dropna().str.fullmatch("[0-9a-f]{8}").all()
    assert report["drift"]["share"] == 0.3 and 0.2 < report["ctr"]["day_1"] < 0.26


def test_drift_renews_head_rows_of_the_teacher_and_moves_the_rest():
    from ctrflow.synth.movielens import World, draw_teacher, make_teacher

    teacher = make_teacher(0, World(0))
    drift = Drift(0.25, 0)
    fresh = draw_teacher(drift.rng(1))
    moved = drift.move(teacher, fresh, 1)
    head = len(teacher.tables[0]) - 2
    renewed = drift.renewed(0, np.arange(head), 1)
    assert 0.15 < renewed.mean() < 0.35
    assert np.array_equal(moved.tables[0][:head][renewed], fresh.tables[0][:head][renewed])
    kept = moved.tables[0][:head][~renewed]
    mix = np.sqrt(0.75) * teacher.tables[0][:head][~renewed, :-1] + 0.5 * fresh.tables[0][:head][~renewed, :-1]
    assert np.allclose(kept[:, :-1], mix, atol=1e-6)
    assert np.allclose(kept[:, -1], (kept[:, 1:-1] ** 2).sum(1), atol=1e-5)  # the squared norm follows
    assert not moved.tables[0][head].any()  # rarer values still carry no effect
    assert not drift.renewed(0, np.arange(head), 0).any()  # day 0 is the undrifted world


def test_bad_drift_is_one_line(tmp_path, capsys):
    assert main(["synth", "--rows", "10", "--out", str(tmp_path), "--drift", "1.5", "--tracking-uri", "none"]) == 2
    assert "--drift must be in [0, 1)" in capsys.readouterr().err
