"""`ctrflow synth`: Criteo-format day files, realistic columns, a teacher in range, same seed same bytes."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter

import numpy as np
import pytest

from ctrflow.cli import main
from ctrflow.contract.criteo import RAW_COLUMNS, SPARSE
from ctrflow.synth.criteo import MISSING_GROUPS, column_keys, hex_column, synthesize
from ctrflow.synth.teacher import AucCounter, CODES

ROWS = 20_000
HEX8 = re.compile(r"[0-9a-f]{8}")


def read_rows(path) -> list[list[str]]:
    """The fields of every line of a (possibly gzipped) day file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [line.rstrip("\n").split("\t") for line in f]


def column(rows, name) -> list[str]:
    """One raw column by name."""
    j = RAW_COLUMNS.index(name)
    return [r[j] for r in rows]


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Two days of 20k rows, seed 0, with their report."""
    out = tmp_path_factory.mktemp("synth")
    report = synthesize(out, ROWS, 2, seed=0)
    return out, report, [read_rows(out / f"day_{d}.tsv") for d in range(2)]


def test_same_seed_gives_identical_bytes(tmp_path, days):
    out, _, _ = days
    again = tmp_path / "again"
    synthesize(again, ROWS, 2, seed=0)
    for name in ("day_0.tsv", "day_1.tsv", "synth.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    synthesize(tmp_path / "other", 1000, 1, seed=1)
    assert (tmp_path / "other/day_0.tsv").read_bytes()[:5000] != (out / "day_0.tsv").read_bytes()[:5000]


def test_rows_are_raw_criteo_format(days):
    out, _, _ = days
    line = re.compile(r"[01](\t-?\d*){13}(\t([0-9a-f]{8})?){26}\n")  # label, I1..I13, C1..C26
    for d in range(2):
        with open(out / f"day_{d}.tsv") as f:
            lines = f.readlines()
        assert len(lines) == ROWS
        bad = [i for i, text in enumerate(lines) if not line.fullmatch(text)]
        assert not bad, lines[bad[0]]
    assert not list(out.glob("*.tmp"))


def test_missing_rates_follow_criteo(days):
    _, _, data = days
    rows = data[0]
    for names, rate in MISSING_GROUPS:
        missing = [np.array([v == "" for v in column(rows, n)]) for n in names]
        assert abs(missing[0].mean() - rate) < 0.015, (names, missing[0].mean(), rate)
        for other in missing[1:]:  # columns of a group go missing together, as in the real logs
            assert (other == missing[0]).all(), names
    assert all(v != "" for v in column(rows, "C1"))


def test_integers_are_heavy_tailed_with_negative_i2(days):
    _, _, data = days
    i2 = np.array([int(v) for v in column(data[0], "I2")])
    assert set(i2[i2 < 0]) <= {-1, -2} and 0.07 < (i2 < 0).mean() < 0.13
    i5 = np.array([int(v) for v in column(data[0], "I5") if v])
    assert i5.min() >= 0 and np.median(i5) > 100 and i5.max() > 100 * np.median(i5)


def test_categories_are_zipf_like_with_criteo_cardinalities(days):
    _, _, data = days
    rows = data[0]
    counts = {name: Counter(v for v in column(rows, name) if v) for name in SPARSE}
    assert len(counts["C9"]) <= 3 and len(counts["C20"]) <= 4 and len(counts["C17"]) <= 10
    big = counts["C3"]
    singletons = sum(1 for c in big.values() if c == 1)
    assert len(big) > 5000 and singletons > 0.5 * len(big)  # rare values: the frequency threshold matters
    assert big.most_common(1)[0][1] > 0.02 * ROWS  # ... and a frequent head
    assert 50 < sum(1 for c in big.values() if c >= 6) < 2000


def test_value_universe_is_stable_across_days(days):
    _, _, (day0, day1) = days
    for name in ("C3", "C7", "C13"):
        top0 = {v for v, _ in Counter(v for v in column(day0, name) if v).most_common(100)}
        top1 = {v for v, _ in Counter(v for v in column(day1, name) if v).most_common(100)}
        assert len(top0 & top1) > 70, name


def test_teacher_auc_and_ctr_in_range(days):
    _, report, data = days
    for d, rows in enumerate(data):
        key = f"day_{d}"
        ctr = np.mean([r[0] == "1" for r in rows])
        assert report["ctr"][key] == pytest.approx(ctr, abs=1e-6)
        assert 0.20 <= ctr <= 0.26
        assert 0.75 <= report["teacher_auc"][key] <= 0.85
    saved = json.loads((days[0] / "synth.json").read_text())
    assert saved["teacher_auc"] == report["teacher_auc"] and saved["rows"] == ROWS and saved["seed"] == 0


def test_auc_counter_is_exact_with_ties():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 50, 5000).astype(np.int32)  # many ties
    labels = rng.random(5000) < codes / 60
    counter = AucCounter()
    counter.update(codes[:2000], labels[:2000])
    counter.update(codes[2000:], labels[2000:])
    pos, neg = codes[labels], codes[~labels]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert counter.auc() == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-12)
    assert len(counter.pos) == CODES


def test_hex_values_are_hashes_formatted_as_8_digits():
    ranks = np.array([0, -1, 5, 123456789, 0])
    values = hex_column(ranks, int(column_keys(0)[2])).to_pylist()
    assert values[1] == "" and values[0] == values[4] != values[2]
    assert all(HEX8.fullmatch(v) for v in values if v)


def test_gzip_output_is_the_same_rows(tmp_path):
    synthesize(tmp_path / "plain", 3000, 1, seed=5)
    synthesize(tmp_path / "gz", 3000, 1, seed=5, gzip=True)
    with gzip.open(tmp_path / "gz/day_0.tsv.gz", "rb") as f:
        assert f.read() == (tmp_path / "plain/day_0.tsv").read_bytes()
    synthesize(tmp_path / "gz2", 3000, 1, seed=5, gzip=True)
    assert (tmp_path / "gz2/day_0.tsv.gz").read_bytes() == (tmp_path / "gz/day_0.tsv.gz").read_bytes()


def test_cli_writes_days_and_report(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["synth", "--rows", "2000", "--days", "3", "--seed", "2", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["day_0.tsv", "day_1.tsv", "day_2.tsv", "synth.json"]
    report = json.loads((out / "synth.json").read_text())
    assert set(report["teacher_auc"]) == {"day_0", "day_1", "day_2"}
    assert "teacher auc" in capsys.readouterr().out


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    assert main(["synth", "--rows", "0", "--out", str(tmp_path / "x")]) == 2
    (tmp_path / "file").write_text("")
    assert main(["synth", "--rows", "10", "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "--rows" in err and "file" in err and "Traceback" not in err


# --- the movielens-like dataset ---------------------------------------------------------------

ML_ROWS = 20_000


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    """Two movielens-like days of 20k rows, seed 0, with their report."""
    import pyarrow.csv as pa_csv

    from ctrflow.synth.movielens import synthesize as synthesize_movielens

    out = tmp_path_factory.mktemp("movielens")
    report = synthesize_movielens(out, ML_ROWS, 2, seed=0)
    strings = pa_csv.ConvertOptions(strings_can_be_null=False, column_types={
        c: "string" for c in ("userId", "movieId", "genres", "age", "price", "timestamp", "liked")})
    return out, report, [pa_csv.read_csv(out / f"day_{d}.csv", convert_options=strings).to_pydict()
                         for d in range(2)]


def test_movielens_same_seed_same_bytes_other_seed_other_rows(tmp_path, movielens):
    from ctrflow.synth.movielens import synthesize as synthesize_movielens

    out, _, _ = movielens
    synthesize_movielens(tmp_path / "again", ML_ROWS, 2, seed=0)
    for name in ("day_0.csv", "day_1.csv", "movielens.yaml", "synth.json"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    synthesize_movielens(tmp_path / "other", 1000, 1, seed=1)
    assert (tmp_path / "other/day_0.csv").read_bytes()[:3000] != (out / "day_0.csv").read_bytes()[:3000]


def test_movielens_rows_are_the_csv_its_description_describes(movielens):
    import yaml

    from ctrflow.contract.movielens import description

    out, _, days = movielens
    described = yaml.safe_load((out / "movielens.yaml").read_text())
    assert described == description()
    with open(out / "day_0.csv") as f:
        assert f.readline() == "userId,movieId,genres,age,price,timestamp,liked\n"
    rows = days[0]
    assert len(rows["liked"]) == ML_ROWS and set(rows["liked"]) == {"0", "1"}
    named = {described["label"], *described["dense"], *described["categorical"], *described["multi_hot"]}
    assert set(rows) - named == {"timestamp"}  # the one column the description leaves out
    genres = described["multi_hot"]["genres"]
    lists = [g.split(genres["separator"]) for g in rows["genres"] if g]
    assert max(len(g) for g in lists) == genres["max_length"] and all(len(set(g)) == len(g) for g in lists)
    assert 0.005 < rows["genres"].count("") / ML_ROWS < 0.05  # some movies list no genre
    assert 0.04 < rows["price"].count("") / ML_ROWS < 0.06  # 5% of prices unknown
    prices = np.array([float(p) for p in rows["price"] if p])
    ages = np.array([int(a) for a in rows["age"]])
    assert prices.min() >= 0.99 and prices.max() <= 24.99 and 0 <= ages.min() and ages.max() <= 80
    stamps = np.array([int(t) for t in rows["timestamp"]])
    assert (np.diff(stamps) >= 0).all() and stamps[-1] - stamps[0] < 86_400


def test_movielens_ids_are_popularity_skewed_and_stable_across_days(movielens):
    _, _, (day0, day1) = movielens
    users, items = Counter(day0["userId"]), Counter(day0["movieId"])
    assert 5_000 < len(users) < 15_000 and users.most_common(1)[0][1] > 0.005 * ML_ROWS
    assert sum(1 for c in users.values() if c == 1) > 0.3 * len(users)  # a long tail of rare users
    assert items.most_common(1)[0][1] > 0.02 * ML_ROWS
    top0 = {v for v, _ in items.most_common(50)}
    top1 = {v for v, _ in Counter(day1["movieId"]).most_common(50)}
    assert len(top0 & top1) > 40
    genre_of = {}
    for day in (day0, day1):  # a movie's genres, age and price are the movie's, not the row's
        for item, genres, age in zip(day["movieId"], day["genres"], day["age"]):
            assert genre_of.setdefault(item, (genres, age)) == (genres, age)


def test_movielens_teacher_auc_and_like_rate_in_range(movielens):
    out, report, days = movielens
    for d, rows in enumerate(days):
        rate = np.mean([v == "1" for v in rows["liked"]])
        assert report["ctr"][f"day_{d}"] == pytest.approx(rate, abs=1e-6)
        assert 0.30 <= rate <= 0.40
        assert 0.75 <= report["teacher_auc"][f"day_{d}"] <= 0.85
    saved = json.loads((out / "synth.json").read_text())
    assert saved["teacher_auc"] == report["teacher_auc"] and saved["description"] == "movielens.yaml"
    assert saved["dataset"] == "movielens-like"


def test_teacher_bags_add_every_value_and_empty_bags_take_the_missing_row():
    from ctrflow.synth.teacher import Teacher, fm_table

    rng = np.random.default_rng(1)
    bag = fm_table(rng.standard_normal(5), rng.standard_normal((5, 4))).astype(np.float32)
    bag[3] = 0.0  # the row every value past the head takes (head = 3)
    teacher = Teacher(tables=(), dense_table=np.zeros((0, 6)), dense_mu=np.zeros(0), dense_sd=np.ones(0),
                      bag_tables=(bag,))
    ranks = np.array([[0, 2, -1], [2, 0, -1], [-1, -1, -1], [7, -1, -1]])
    linear, pairwise = teacher.parts(np.zeros((4, 0)), np.zeros((4, 0), np.int64), (ranks,))
    assert linear[0] == pytest.approx(bag[0, 0] + bag[2, 0]) and linear[0] == linear[1]  # order-free
    assert linear[2] == pytest.approx(bag[4, 0]) and linear[3] == 0.0  # missing row; a rare value: nothing
    latent = bag[[0, 2], 1:5]
    assert pairwise[0] == pytest.approx(float(latent[0] @ latent[1]), rel=1e-5)  # the FM pair of the two


def test_cli_synthesizes_movielens_and_refuses_unknown_datasets(tmp_path, capsys):
    out = tmp_path / "ml"
    assert main(["synth", "--dataset", "movielens-like", "--rows", "500", "--days", "2", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["day_0.csv", "day_1.csv", "movielens.yaml", "synth.json"]
    assert "movielens.yaml" in capsys.readouterr().out
    assert main(["synth", "--dataset", "imdb", "--rows", "10", "--out", str(tmp_path / "x")]) == 2
    assert "--dataset 'imdb'" in capsys.readouterr().err and not (tmp_path / "x").exists()
