"""`ctrflow preprocess --vocab-from`: a new day grows yesterday's vocabularies. Every earlier value keeps its
id, new values reaching the threshold follow (by the day's count, then value), counts run on (days summed),
the rows' ids mean the values they meant, the fan-out's merge gives the same, and bad input is named."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ctrflow.cli import main
from ctrflow.contract.criteo import SPARSE
from ctrflow.errors import UserError
from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from tests.fixtures.tables import movie_rows, write_csv, write_description
from tests.fixtures.preprocess import random_rows, row, write

THRESHOLD = 3


def vocab(out, name):
    table = pq.read_table(out / "vocab" / f"{name}.parquet")
    return table.column("value").to_pylist(), table.column("count").to_pylist()


def expected_growth(old, all_today, threshold):
    """What the grown vocabulary must hold: `old` (values, counts) with today's counts added, then
    today's new values reaching the threshold by count (descending), then value."""
    today = dict(zip(*all_today))
    values = list(old[0]) + sorted((v for v in today if v not in set(old[0]) and today[v] >= threshold),
                                   key=lambda v: (-today[v], v.encode()))
    counts = [c + today.get(v, 0) for v, c in zip(*old)] + [today[v] for v in values[len(old[0]):]]
    return values, counts


def decoded(out, name, split="train"):
    """Each row's value of a one-id feature: its id read through the vocabulary (None: missing, "<oov>")."""
    values = vocab(out, name)[0]
    ids = pq.read_table(out / split).column(name).to_numpy()
    return [None if i == 0 else "<oov>" if i == 1 else values[i - 2] for i in ids]


def criteo_days(tmp_path):
    """Two days of Criteo rows sharing most values; day 1 adds new ones and some "other" strings."""
    day0 = random_rows(900, seed=1) + [row(sparse={"C1": "abc"})] * 4
    day1 = random_rows(900, seed=2) + [row(sparse={"C1": "abc"}), row(sparse={"C1": "zz-new"})] * 3
    day1 += [row(sparse={"C2": f"{0xfeed0000 + k:08x}"}) for k in range(5) for _ in range(k + 1)]  # counts 1..5
    return write(tmp_path / "day0.tsv", day0), write(tmp_path / "day1.tsv", day1)


def test_criteo_day_grows_yesterdays_vocabulary(tmp_path):
    day0, day1 = criteo_days(tmp_path)
    d0 = tmp_path / "d0"
    preprocess([day0], [day1], d0, freq_threshold=THRESHOLD, workers=2, chunk_rows=200)
    d1 = tmp_path / "d1"
    summary = preprocess([day1], [], d1, freq_threshold=THRESHOLD, workers=2, chunk_rows=200, vocab_from=d0)
    counted = tmp_path / "all"  # day 1 alone at threshold 1: every value's count today
    preprocess([day1], [], counted, freq_threshold=1, workers=1)
    for name in SPARSE:
        grown = vocab(d1, name)
        assert grown == expected_growth(vocab(d0, name), vocab(counted, name), THRESHOLD), name
        # each row's id still means its value (or OOV where the grown vocabulary lacks it)
        assert decoded(d1, name) == [v if v is None or v in set(grown[0]) else "<oov>" for v in decoded(counted, name)]
    c1 = vocab(d1, "C1")[0]
    assert c1.index("abc") < len(vocab(d0, "C1")[0]) <= c1.index("zz-new")  # "other" strings grow too
    assert [v for v in vocab(d1, "C2")[0] if v.startswith("feed")] == ["feed0004", "feed0003", "feed0002"]
    schema = Schema.load(d1)
    assert schema.parent == {"vocab_hash": Schema.load(d0).vocab_hash, "path": str(d0.resolve()),
                             "cardinalities": Schema.load(d0).cardinalities}
    assert all(schema.cardinalities[c] >= Schema.load(d0).cardinalities[c] for c in SPARSE)
    assert summary["cardinalities"] == schema.cardinalities
    assert "parent" not in json.loads((d0 / "schema.json").read_text())  # made from scratch: no parent key


def test_growth_is_the_same_over_many_merge_ranges_and_workers(tmp_path):
    day0, day1 = criteo_days(tmp_path)
    d0 = tmp_path / "d0"
    preprocess([day0], [], d0, freq_threshold=THRESHOLD, workers=1)
    one, many = tmp_path / "one", tmp_path / "many"
    preprocess([day1], [], one, freq_threshold=THRESHOLD, workers=1, vocab_from=d0)
    preprocess([day1], [], many, freq_threshold=THRESHOLD, workers=2, chunk_rows=100, vocab_from=d0,
               range_entries=16, spill_entries=50)
    for name in ("C1", "C2", "C3", "C26"):
        assert vocab(one, name) == vocab(many, name)
    assert Schema.load(one).vocab_hash == Schema.load(many).vocab_hash


def test_three_days_keep_every_id_and_sum_counts(tmp_path):
    days = [write(tmp_path / f"day{k}.tsv", random_rows(600, seed=10 + k)) for k in range(3)]
    dirs = [tmp_path / f"d{k}" for k in range(3)]
    preprocess([days[0]], [], dirs[0], freq_threshold=THRESHOLD, workers=1)
    for k in (1, 2):
        preprocess([days[k]], [], dirs[k], freq_threshold=THRESHOLD, workers=1, vocab_from=dirs[k - 1])
    counted = tmp_path / "counted"
    preprocess(days, [], counted, freq_threshold=1, workers=1)  # the three days' total per value
    total = dict(zip(*vocab(counted, "C5")))
    values, counts = vocab(dirs[2], "C5")
    assert values[:len(vocab(dirs[1], "C5")[0])] == vocab(dirs[1], "C5")[0]
    assert values[:len(vocab(dirs[0], "C5")[0])] == vocab(dirs[0], "C5")[0]
    day0 = set(vocab(dirs[0], "C5")[0])
    assert all(counts[i] == total[v] for i, v in enumerate(values) if v in day0)  # kept since day 0: all 3 summed
    assert Schema.load(dirs[2]).parent["path"] == str(dirs[1].resolve())


def test_described_table_with_multi_hot_grows(tmp_path):
    description = write_description(tmp_path / "movies.yaml")
    first, second = movie_rows(500, seed=0), movie_rows(500, seed=1)
    second["userId"] = [u if k % 3 else f"new{k % 7}" for k, u in enumerate(second["userId"])]
    second["genres"] = [g + ("|Western" if k % 5 == 0 else "") for k, g in enumerate(second["genres"])]
    d0, d1 = tmp_path / "d0", tmp_path / "d1"
    preprocess([write_csv(tmp_path / "a.csv", first)], [], d0, dataset=description, workers=1)
    preprocess([write_csv(tmp_path / "b.csv", second)], [], d1, dataset=description, workers=2, vocab_from=d0)
    counted = tmp_path / "all"
    every = write_description(tmp_path / "every.yaml", freq_threshold={"default": 1})  # every value's count today
    preprocess([write_csv(tmp_path / "b.csv", second)], [], counted, dataset=every, workers=1)
    thresholds = {"userId": 2, "movieId": 3, "genres": 3}  # the description's
    for name, threshold in thresholds.items():
        assert vocab(d1, name) == expected_growth(vocab(d0, name), vocab(counted, name), threshold), name
    assert "new1" in vocab(d1, "userId")[0] and "Western" in vocab(d1, "genres")[0]
    genres = vocab(d1, "genres")[0]
    lists = pq.read_table(d1 / "train").column("genres").to_pylist()
    assert any(genres[i - 2] == "Western" for ids in lists for i in ids if i >= 2)
    assert Schema.load(d1).parent["vocab_hash"] == Schema.load(d0).vocab_hash


def test_fan_out_merge_takes_vocab_from_and_equals_the_single_run(tmp_path):
    day0, day1 = criteo_days(tmp_path)
    d0 = tmp_path / "d0"
    preprocess([day0], [], d0, freq_threshold=THRESHOLD, workers=1)
    single = tmp_path / "single"
    preprocess([day1], [], single, freq_threshold=THRESHOLD, workers=1, chunk_rows=150, vocab_from=d0, seed=7)
    counts = tmp_path / "counts"
    assert main(["preprocess", "count", "--input", day1, "--chunk-rows", "150", "--seed", "7", "--out",
                 str(counts)]) == 0
    merged = tmp_path / "merged"
    assert main(["preprocess", "merge", "--counts", str(counts), "--out", str(merged), "--freq-threshold",
                 str(THRESHOLD), "--vocab-from", str(d0)]) == 0
    parts = tmp_path / "parts"
    assert main(["preprocess", "transform", "--input", day1, "--chunk-rows", "150", "--seed", "7",
                 "--vocab", str(merged), "--out", str(parts)]) == 0
    out = tmp_path / "fanned"
    assert main(["preprocess", "finalize", "--counts", str(counts), "--vocab", str(merged), "--parts", str(parts),
                 "--out", str(out)]) == 0
    for name in SPARSE:
        assert vocab(out, name) == vocab(single, name)
    for part in sorted((single / "train").glob("part-*.parquet")):
        assert (out / "train" / part.name).read_bytes() == part.read_bytes()
    assert Schema.load(out).parent == Schema.load(single).parent
    assert Schema.load(out).vocab_hash == Schema.load(single).vocab_hash


def test_bad_vocab_from_is_one_line_naming_the_difference(tmp_path, capsys):
    day0, day1 = criteo_days(tmp_path)
    with pytest.raises(UserError, match="--vocab-from .*: no such directory"):
        preprocess([day1], [], tmp_path / "x", vocab_from=tmp_path / "absent")
    with pytest.raises(UserError, match="no schema.json \\(not a `ctrflow preprocess` output directory\\)"):
        preprocess([day1], [], tmp_path / "x", vocab_from=tmp_path)
    description = write_description(tmp_path / "movies.yaml")
    movies = tmp_path / "movies"
    preprocess([write_csv(tmp_path / "a.csv", movie_rows(200))], [], movies, dataset=description, workers=1)
    with pytest.raises(UserError, match="another dataset description: dense features differ: only there year, "
                                        "price; only here I1, I2, I3, I4 \\(\\+9 more\\)"):
        preprocess([day1], [], tmp_path / "x", vocab_from=movies)
    d0 = tmp_path / "d0"
    preprocess([day0], [], d0, freq_threshold=THRESHOLD, workers=1)
    with pytest.raises(UserError, match="--vocab-from runs on the CPU engine only"):
        preprocess([day1], [], tmp_path / "x", vocab_from=d0, engine="gpu")
    c1 = pq.read_table(d0 / "vocab" / "C1.parquet")
    pq.write_table(c1.slice(1), d0 / "vocab" / "C1.parquet")  # a vocabulary that no longer fits its schema
    assert main(["preprocess", "--train", day1, "--out", str(tmp_path / "x"), "--vocab-from", str(d0)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vocabulary hash" in err and "--vocab-from" in err
    assert not (tmp_path / "x").exists()  # refused before any output


def test_bad_vocab_from_on_the_merge_step(tmp_path, capsys):
    day0, day1 = criteo_days(tmp_path)
    counts = tmp_path / "counts"
    assert main(["preprocess", "count", "--input", day1, "--out", str(counts)]) == 0
    assert main(["preprocess", "merge", "--counts", str(counts), "--out", str(tmp_path / "m"),
                 "--vocab-from", str(counts)]) == 2
    assert "no schema.json" in capsys.readouterr().err

