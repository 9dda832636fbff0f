"""`ctrflow preprocess`: the processed-data conventions, determinism, accounting and bad input."""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ctrflow.cli import main
from ctrflow.ingest import output
from ctrflow.ingest.output import file_digest
from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from ctrflow.contract.criteo import DENSE, SPARSE
from ctrflow.contract.transform import transform_raw
from ctrflow.contract.vocab import Vocabularies
from ctrflow.errors import UserError
from tests.fixtures.preprocess import random_rows, row, write


def table(out, split="train"):
    return pq.read_table(out / split)


def test_ids_follow_the_conventions(tmp_path):
    c1 = ["aaaaaaaa"] * 3 + ["cccccccc"] * 2 + ["bbbbbbbb"] * 2 + ["xyz"] * 2 + ["dddddddd", ""]
    train = write(tmp_path / "train.tsv", [row("1", {"I1": "3", "I2": "-5"}, {"C1": v}) for v in c1])
    valid = write(tmp_path / "valid.tsv", [row("0", {"I1": ""}, {"C1": v}) for v in ["eeeeeeee", "aaaaaaaa", "", "xyz"]])
    out = tmp_path / "out"
    preprocess([train], [valid], out, freq_threshold=2, workers=1)
    ids = table(out).column("C1").to_pylist()
    # aaaaaaaa most frequent; bbbbbbbb, cccccccc, xyz tie at 2 and go by value; dddddddd rare; "" missing
    assert ids == [2] * 3 + [4] * 2 + [3] * 2 + [5] * 2 + [1, 0]
    assert table(out, "valid").column("C1").to_pylist() == [1, 2, 0, 5]
    vocab = pq.read_table(out / "vocab" / "C1.parquet").to_pylist()
    assert vocab == [{"value": "aaaaaaaa", "count": 3}, {"value": "bbbbbbbb", "count": 2},
                     {"value": "cccccccc", "count": 2}, {"value": "xyz", "count": 2}]
    first = table(out).slice(0, 1).to_pylist()[0]
    assert first["I1"] == pytest.approx(math.log(4)) and first["I2"] == 0.0 and first["I3"] == 0.0
    assert first["label"] == 1.0 and first["C2"] == 0
    schema = Schema.load(out)
    assert schema.cardinalities["C1"] == 6 and schema.cardinalities["C2"] == 2
    assert Vocabularies.load(out).hash() == schema.vocab_hash
    assert Vocabularies.load(out).cardinalities() == schema.cardinalities
    assert schema.rows == {"train": 11, "valid": 4} and schema.freq_threshold == 2
    assert {f["split"] for f in schema.files} == {"train", "valid"}
    assert all(f["digest"] == file_digest(Path(f["path"])) and f["digest"].startswith("crc32-tree-1MiB:")
               for f in schema.files)
    assert str(table(out).schema.field("C1").type) == "int32" and str(table(out).schema.field("I1").type) == "float"
    assert not any(field.nullable for field in table(out).schema)  # Parquet REQUIRED columns: never null


def test_output_is_identical_for_any_workers_and_chunk_size(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "PIECE_BYTES", 4096)  # the input digest's pieces then straddle the blocks
    src = write(tmp_path / "in.tsv", random_rows(2000, seed=1))
    outs = []
    for workers, chunk_rows, budget in [(1, 100_000, 1 << 22), (2, 300, 1 << 22), (2, 97, 500)]:
        out = tmp_path / f"out-{workers}-{chunk_rows}"
        preprocess([src], out=out, freq_threshold=3, valid_fraction=0.2, workers=workers, chunk_rows=chunk_rows, seed=7,
                   spill_entries=budget, range_entries=budget)  # a small budget: many runs, merged in ranges
        outs.append(out)
    reference = outs[0]
    for out in outs[1:]:
        for split in ("train", "valid"):
            assert table(out, split).equals(table(reference, split))
        assert Schema.load(out).vocab_hash == Schema.load(reference).vocab_hash
        assert Schema.load(out).files == Schema.load(reference).files  # the digests the workers made too
        assert Schema.load(out).cardinalities == Schema.load(reference).cardinalities
        assert pq.read_table(out / "vocab" / "C3.parquet").equals(pq.read_table(reference / "vocab" / "C3.parquet"))
    rows = Schema.load(reference).rows
    assert rows["train"] + rows["valid"] == 2000 and 300 < rows["valid"] < 500
    assert Schema.load(reference).files[0]["digest"] == file_digest(Path(src)) and Path(src).stat().st_size > 10 * 4096
    parts = sorted((outs[1] / "train").glob("part-*.parquet"))
    assert len(parts) > 1
    file_list = (outs[1] / "train" / "_file_list.txt").read_text().split()  # HugeCTR's metadata
    assert file_list == [str(len(parts))] + [str(p.resolve()) for p in parts]
    hugectr = json.loads((outs[1] / "train" / "_metadata.json").read_text())
    assert sum(f["num_rows"] for f in hugectr["file_stats"]) == rows["train"] and len(hugectr["cats"]) == 26


def test_rows_keep_input_order(tmp_path):
    lines = [row(str(i % 2), {"I3": str(i)}) for i in range(500)]
    out = tmp_path / "out"
    preprocess([write(tmp_path / "in.tsv", lines)], out=out, workers=2, chunk_rows=60)
    assert np.allclose(table(out).column("I3").to_numpy(), np.log1p(np.arange(500, dtype=np.float32)))


def test_valid_fraction_split_is_seeded(tmp_path):
    src = write(tmp_path / "in.tsv", [row("0", {"I1": str(i)}) for i in range(1000)])
    a, b, c = (tmp_path / n for n in "abc")
    preprocess([src], out=a, valid_fraction=0.3, seed=1, workers=1)
    preprocess([src], out=b, valid_fraction=0.3, seed=1, workers=1, chunk_rows=50)
    preprocess([src], out=c, valid_fraction=0.3, seed=2, workers=1)
    assert table(a, "valid").equals(table(b, "valid"))
    assert not table(a, "valid").equals(table(c, "valid"))
    assert table(a, "train").num_rows + table(a, "valid").num_rows == 1000


def test_gzip_input_matches_plain(tmp_path):
    lines = random_rows(400, seed=2)
    plain = write(tmp_path / "in.tsv", lines)
    packed = tmp_path / "in.tsv.gz"
    packed.write_bytes(gzip.compress("".join(f"{x}\n" for x in lines[:150]).encode())
                       + gzip.compress("".join(f"{x}\n" for x in lines[150:]).encode()))  # two members
    preprocess([plain], out=tmp_path / "a", workers=1, freq_threshold=2)
    preprocess([str(packed)], out=tmp_path / "b", workers=2, freq_threshold=2, chunk_rows=50)
    assert table(tmp_path / "b").equals(table(tmp_path / "a"))
    assert Schema.load(tmp_path / "b").vocab_hash == Schema.load(tmp_path / "a").vocab_hash
    halves = [tmp_path / "h1.tsv.gz", tmp_path / "h2.tsv.gz"]  # as many gzip files as workers: a file per task
    halves[0].write_bytes(gzip.compress("".join(f"{x}\n" for x in lines[:150]).encode()))
    halves[1].write_bytes(gzip.compress("".join(f"{x}\n" for x in lines[150:]).encode()))
    preprocess([str(h) for h in halves], out=tmp_path / "c", workers=2, freq_threshold=2, chunk_rows=50)
    assert table(tmp_path / "c").equals(table(tmp_path / "a"))
    assert Schema.load(tmp_path / "c").vocab_hash == Schema.load(tmp_path / "a").vocab_hash


BAD_ROWS = [
    (row("0") + "\textra", r"line 3: expected 40 tab-separated fields, found 41"),
    (row("0", {"I4": "1.5"}), r"line 3: I4: dense value is not an integer, got '1\.5'"),
    (row("2"), r"line 3: label: label must be 0 or 1, got '2'"),
    ("", r"line 3: expected 40 tab-separated fields, found 1"),
]


@pytest.mark.parametrize("bad,message", BAD_ROWS)
def test_bad_row_stops_with_file_and_line(tmp_path, bad, message):
    src = write(tmp_path / "in.tsv", [row("0"), row("1"), bad, row("0")])
    out = tmp_path / "out"
    with pytest.raises(UserError, match=re.escape(src) + ": " + message) as err:
        preprocess([src], out=out, workers=1)
    assert "\n" not in str(err.value)
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "in.tsv"]  # nothing left behind


@pytest.mark.parametrize("workers", [1, 2])
def test_truncated_gzip_names_the_line(tmp_path, workers):
    data = gzip.compress("".join(line + "\n" for line in random_rows(200, seed=3)).encode())
    src = tmp_path / "cut.tsv.gz"
    src.write_bytes(data[: len(data) // 2])
    (tmp_path / "ok.tsv.gz").write_bytes(data)
    with pytest.raises(UserError, match=r"cut\.tsv\.gz: (after )?line \d+: truncated gzip"):
        preprocess([str(tmp_path / "ok.tsv.gz"), str(src)], out=tmp_path / "out", workers=workers, chunk_rows=30)
    assert not (tmp_path / "out").exists()


def test_skip_mode_writes_rejected_rows_and_accounts_for_them(tmp_path):
    lines = [row("0"), row("3"), row("1", {"I1": "x"}), row("0") + "\t", row("1")]
    src = write(tmp_path / "in.tsv", lines * 50)
    out = tmp_path / "out"
    result = preprocess([src], out=out, on_bad_rows="skip", workers=2, chunk_rows=40)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows_read"] == 250 and stats["rows_written"] == 100 and stats["rows_rejected"] == 150
    assert stats["files"][0]["rows_read"] == stats["files"][0]["rows_written"] + stats["files"][0]["rows_rejected"]
    assert result["rows"] == {"train": 100, "valid": 0} and table(out).num_rows == 100
    rejected = (out / "rejected.tsv").read_text().splitlines()
    assert len(rejected) == 151 and rejected[0] == "file\tline\treason\traw"
    assert [r.split("\t")[1] for r in rejected[1:4]] == ["2", "3", "4"]
    assert rejected[1].split("\t")[2] == "label: label must be 0 or 1, got '3'"


def test_skip_mode_counts_blocks_with_no_good_row(tmp_path):
    lines = [row("1")] * 5 + ["garbage"] * 300 + [row("0"), "x\ty", row("1")]
    src = write(tmp_path / "in.tsv", lines)
    out = tmp_path / "out"
    preprocess([src], out=out, on_bad_rows="skip", workers=2, chunk_rows=20, valid_fraction=0.5)
    stats = json.loads((out / "stats.json").read_text())
    assert (stats["rows_read"], stats["rows_written"], stats["rows_rejected"]) == (308, 7, 301)
    rejected = (out / "rejected.tsv").read_text().splitlines()
    assert [r.split("\t")[1] for r in rejected[1:3]] == ["6", "7"] and rejected[-1].split("\t")[1] == "307"


def test_stats_record_missing_rates_and_passes(tmp_path):
    src = write(tmp_path / "in.tsv", [row("0", {"I1": "1"}, {"C1": "aaaaaaaa"}), row("1", {}, {"C2": "bbbbbbbb"})])
    out = tmp_path / "out"
    preprocess([src], out=out, freq_threshold=1, workers=1)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["columns"]["I1"]["missing_rate"] == 0.5 and stats["columns"]["I2"]["missing_rate"] == 1.0
    assert stats["columns"]["C1"] == {"missing_rate": 0.5, "cardinality": 3, "distinct_train": 1}
    assert set(stats["passes"]) >= {"fit_seconds", "transform_seconds", "total_seconds"}


def test_rerun_replaces_earlier_output_but_not_foreign_dirs(tmp_path):
    src = write(tmp_path / "in.tsv", [row("0"), row("1")])
    out = tmp_path / "out"
    preprocess([src], out=out, workers=1)
    preprocess([src], out=out, workers=1)
    assert Schema.load(out).rows["train"] == 2
    stale = tmp_path / "out.tmp-999999999"  # left by a killed run (no such process)
    (stale / "train").mkdir(parents=True)
    preprocess([src], out=out, workers=1)
    assert not stale.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a `ctrflow preprocess` output"):
        preprocess([src], out=foreign, workers=1)


def test_cli_prints_one_line_error_and_exits_2(tmp_path, capsys):
    src = write(tmp_path / "in.tsv", [row("0"), row("0", {"I2": "abc"})])
    code = main(["preprocess", "--train", src, "--out", str(tmp_path / "out"), "--workers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{src}: line 2: I2" in err
    assert main(["preprocess", "--train", str(tmp_path / "*.tsv"), "--out", str(tmp_path / "o2"),
                 "--on-bad-rows", "skip", "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rows_rejected"] == 1


def test_transform_raw_equals_the_batch_path(tmp_path):
    lines = random_rows(300, seed=4) + [row("0", {"I2": "-7"}, {"C5": "odd value"})] * 3
    out = tmp_path / "out"
    preprocess([write(tmp_path / "in.tsv", lines)], out=out, freq_threshold=2, workers=1)
    fields = [line.split("\t") for line in lines]
    columns = {c: [f[1 + j] for f in fields] for j, c in enumerate((*DENSE, *SPARSE))}
    dense, sparse = transform_raw(columns, Vocabularies.load(out))
    batch = table(out)
    assert dense.dtype == np.float32 and sparse.dtype == np.int32 and sparse.shape == (303, 26)
    assert np.array_equal(dense, np.stack([batch.column(c).to_numpy() for c in DENSE], axis=1))
    assert np.array_equal(sparse, np.stack([batch.column(c).to_numpy() for c in SPARSE], axis=1))
    assert sparse[-1, SPARSE.index("C5")] >= 2
    as_bytes = {c: np.array([v.encode() for v in values], dtype=object) for c, values in columns.items()}
    assert np.array_equal(transform_raw(as_bytes, Vocabularies.load(out))[1], sparse)  # Triton sends BYTES
    columns["I7"][5] = "seven"
    with pytest.raises(UserError, match="field I7, row 5"):
        transform_raw(columns, Vocabularies.load(out))


def test_real_criteo_sample_matches_published_cardinalities(criteo_dir, tmp_path):
    out = tmp_path / "out"
    preprocess([str(criteo_dir / "train_head_10109.txt")], out=out, workers=2)
    expected = {}
    for line in (criteo_dir / "STATS.txt").read_text().split("file=test")[0].splitlines():
        if m := re.match(r"(C\d+):.*distinct_count>=6=(\d+)", line):
            expected[m.group(1)] = int(m.group(2)) + 2
    assert Schema.load(out).cardinalities == expected
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows_read"] == stats["rows_written"] == 10109
    assert stats["columns"]["C3"]["missing_rate"] == pytest.approx(0.0358, abs=1e-4)


def test_tracker_gets_params_rows_cardinalities_and_artifacts(tmp_path):
    from ctrflow.tracking import Tracker

    class Recorder(Tracker):
        def __init__(self):
            self.params, self.metrics, self.artifacts = {}, {}, []

        def log_params(self, params):
            self.params.update(params)

        def log_metrics(self, metrics, step=None):
            self.metrics.update(metrics)

        def log_artifact(self, path, artifact_path=None):
            self.artifacts.append(Path(path).name)

    tracker = Recorder()
    src = write(tmp_path / "in.tsv", [row("0", {}, {"C1": "aaaaaaaa"})] * 3)
    preprocess([src], out=tmp_path / "out", freq_threshold=2, workers=1, tracker=tracker)
    assert tracker.params["freq_threshold"] == 2 and tracker.metrics["rows_train"] == 3
    assert tracker.metrics["cardinality_C1"] == 3 and "fit_seconds" in tracker.metrics
    assert sorted(tracker.artifacts) == ["schema.json", "stats.json"]


def test_schema_carries_the_criteo_description_features_and_label_rate(tmp_path):
    lines = random_rows(400, seed=8)
    out = tmp_path / "out"
    preprocess([write(tmp_path / "in.tsv", lines)], out=out, freq_threshold=2, workers=2, valid_fraction=0.25,
               chunk_rows=90)
    schema = Schema.load(out)
    assert schema.dataset["name"] == "criteo" and schema.dataset["dense"] == list(DENSE)
    assert schema.dataset["freq_threshold"]["default"] == 2 and schema.dataset["dense_type"] == "integer"
    assert [f.name for f in schema.features.sparse] == list(SPARSE)
    assert [f.cardinality for f in schema.features.sparse] == [schema.cardinalities[c] for c in SPARSE]
    train_labels = table(out).column("label").to_numpy()
    assert schema.label_rate == pytest.approx(train_labels.mean(), abs=1e-9)


def test_the_unlabelled_test_layout_as_training_input_is_named(tmp_path, capsys):
    from ctrflow.cli import main

    test_layout = write(tmp_path / "test.tsv", [line.split("\t", 1)[1] for line in random_rows(30, seed=2)])
    for extra in ([], ["--on-bad-rows", "skip"]):
        code = main(["preprocess", "--train", test_layout, "--out", str(tmp_path / "out"), "--tracking-uri", "none",
                     *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "line 1: expected 40 tab-separated fields, found 39" in err and "unlabelled test layout" in err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
    assert "every input row was rejected (30 read, 0 written" in err  # skip mode: nothing silently empty
