"""`ctrflow preprocess --dataset FILE`: a described CSV/TSV/Parquet table into the feature contract."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctrflow.cli import main
from ctrflow.errors import UserError
from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from tests.fixtures.tables import movie_rows, read_split, write_csv, write_description, write_parquet


def expected_vocab(values, threshold: int) -> list[str]:
    """The id rule: values seen at least `threshold` times, most frequent first, ties by value."""
    counts = Counter(v for v in values if v != "")
    return [v for v, c in sorted(counts.items(), key=lambda item: (-item[1], item[0].encode())) if c >= threshold]


def vocab_values(out, name: str) -> list[str]:
    return pq.read_table(out / "vocab" / f"{name}.parquet").column("value").to_pylist()


def test_a_movies_csv_becomes_the_feature_contract(tmp_path):
    rows = movie_rows(400, seed=1)
    data = write_csv(tmp_path / "movies.csv", rows)
    out = tmp_path / "out"
    summary = preprocess([data], out=out, dataset=write_description(tmp_path / "movies.yaml"), workers=1)
    assert summary["rows"] == {"train": 400, "valid": 0} and summary["rows_rejected"] == 0
    assert vocab_values(out, "userId") == expected_vocab(rows["userId"], 2)  # per-column threshold
    assert vocab_values(out, "movieId") == expected_vocab(rows["movieId"], 3)
    genres = [g for text in rows["genres"] for g in text.split("|")[:3] if g]  # the kept values are counted
    assert vocab_values(out, "genres") == expected_vocab(genres, 3)
    table = read_split(out)
    genres_type = table.schema.field("genres").type
    assert pa.types.is_fixed_size_list(genres_type) and (genres_type.list_size, genres_type.value_type) == \
        (3, pa.int32())
    assert [str(table.schema.field(c).type) for c in ("label", "year", "price", "userId")] == \
        ["float", "float", "float", "int32"]
    users = {v: i + 2 for i, v in enumerate(vocab_values(out, "userId"))}
    assert table.column("userId").to_pylist() == [users.get(v, 1) for v in rows["userId"]]
    genre_ids = {v: i + 2 for i, v in enumerate(vocab_values(out, "genres"))}
    for text, ids in zip(rows["genres"][:50], table.column("genres").to_pylist()[:50]):
        kept = [genre_ids.get(g, 1) for g in text.split("|") if g][:3]
        assert ids == kept + [0] * (3 - len(kept))  # padded with 0
    assert table.column("year").to_pylist() == [float(y) for y in rows["year"]]  # transform: none
    price = np.array([float(p) if p else 0.0 for p in rows["price"]])
    assert np.array_equal(table.column("price").to_numpy(), np.log1p(price).astype(np.float32))
    assert table.column("label").to_pylist() == [float(v) for v in rows["liked"]]
    schema = Schema.load(out)
    assert schema.label_rate == pytest.approx(np.mean([int(v) for v in rows["liked"]]))
    assert schema.dataset["name"] == "movies" and schema.dataset["multi_hot"]["genres"]["max_length"] == 3
    genres_feature = schema.features.sparse[2]
    assert (genres_feature.kind, genres_feature.max_length, genres_feature.pooling) == ("multi_hot", 3, "mean")
    assert [f.transform for f in schema.features.dense] == ["none", "log1p"]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["columns"]["genres"]["truncated_rows"] == sum(len([g for g in t.split("|") if g]) > 3
                                                               for t in rows["genres"])
    assert stats["columns"]["genres"]["missing_rate"] == pytest.approx(rows["genres"].count("") / 400, abs=1e-6)


def test_csv_tsv_parquet_and_gzip_inputs_give_the_same_dataset(tmp_path):
    rows = movie_rows(300, seed=2)
    outs = {}
    inputs = {"csv": (write_csv(tmp_path / "m.csv", rows), {}),
              "tsv": (write_csv(tmp_path / "m.tsv", rows, "\t"), {"format": "tsv"}),
              "parquet": (write_parquet(tmp_path / "m.parquet", rows, row_group_size=70), {"format": "parquet"})}
    gz = tmp_path / "m.csv.gz"
    gz.write_bytes(gzip.compress((tmp_path / "m.csv").read_bytes()))
    inputs["gzip"] = (str(gz), {})
    for kind, (path, changes) in inputs.items():
        outs[kind] = tmp_path / kind
        preprocess([path], out=outs[kind], dataset=write_description(tmp_path / f"{kind}.yaml", **changes),
                   workers=2, chunk_rows=64)
    reference = read_split(outs["csv"])
    for kind, out in outs.items():
        assert read_split(out).equals(reference), kind
        for name in ("userId", "movieId", "genres"):
            assert vocab_values(out, name) == vocab_values(outs["csv"], name)


def test_output_is_the_same_for_any_workers_and_chunk_size(tmp_path, monkeypatch):
    from ctrflow.ingest import output

    monkeypatch.setattr(output, "PIECE_BYTES", 1024)  # the input digest's pieces then straddle the blocks
    rows = movie_rows(500, seed=3)
    data = write_csv(tmp_path / "m.csv", rows)
    described = write_description(tmp_path / "m.yaml")
    outs = []
    for workers, chunk_rows, spill in ((1, 100_000, 1 << 20), (2, 37, 50), (2, 90, 1 << 20)):
        outs.append(tmp_path / f"out-{workers}-{chunk_rows}")
        preprocess([data], out=outs[-1], dataset=described, workers=workers, chunk_rows=chunk_rows,
                   valid_fraction=0.3, seed=4, spill_entries=spill, range_entries=20)
    for out in outs[1:]:
        for split in ("train", "valid"):
            assert read_split(out, split).equals(read_split(outs[0], split))
        assert Schema.load(out).vocab_hash == Schema.load(outs[0]).vocab_hash
        assert Schema.load(out).files[0]["digest"] == output.file_digest(Path(data))  # made by the workers
    assert 0 < Schema.load(outs[0]).rows["valid"] < 300


def test_quoted_delimiters_and_newlines_parse_and_errors_name_the_right_line(tmp_path):
    lines = ["userId,title,genres,year,price,movieId,liked",
             'u1,"Heat, the movie",Action|Drama,1995,3.5,7,1',
             'u2,"a title',
             'over two lines","Drama",2001,,8,0',
             "",
             'u3,"say ""hi""",,1999,1.0,9,1',
             'u4,plain,Comedy,abc,2.0,9,0']
    data = tmp_path / "q.csv"
    data.write_text("\n".join(lines) + "\n")
    described = write_description(tmp_path / "q.yaml")
    with pytest.raises(UserError, match=r"q.csv: line 7: column year: not a number: 'abc'"):
        preprocess([str(data)], out=tmp_path / "out", dataset=described)
    assert not (tmp_path / "out").exists()
    summary = preprocess([str(data)], out=tmp_path / "out", dataset=described, on_bad_rows="skip",
                         freq_threshold=1)
    assert summary["rows_written"] == 3 and summary["rows_rejected"] == 1
    table = read_split(tmp_path / "out")
    assert table.column("year").to_pylist() == [1995.0, 2001.0, 1999.0]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["files"][0]["blank_lines"] == 1 and stats["files"][0]["rows_read"] == 4


def test_line_ends_and_blank_lines_give_the_same_rows_and_name_the_right_line(tmp_path):
    rows = movie_rows(300, seed=8)
    rows.pop("title")  # no quotes anywhere: each line is a row, read without counting lines
    described = write_description(tmp_path / "m.yaml")
    header, *body = Path(write_csv(tmp_path / "plain.csv", rows)).read_text().splitlines()
    variants = {"crlf": ("\r\n".join([header, *body]) + "\r\n", 0),  # (text, blank lines)
                "cr": ("\n".join([header, *body[:150]]) + "\r" + "\n".join(body[150:]) + "\n", 0),  # a lone \r ends a line
                "blank": ("\n".join([header, *body[:100], "", *body[100:], "", ""]) + "\n", 3),
                "blank-crlf": ("\r\n".join([header, *body[:200], "", *body[200:]]) + "\r\n", 1)}
    reference = tmp_path / "plain-out"
    preprocess([str(tmp_path / "plain.csv")], out=reference, dataset=described, workers=2, chunk_rows=64)
    for name, (text, blank) in variants.items():
        data = tmp_path / f"{name}.csv"
        data.write_bytes(text.encode())
        out = tmp_path / f"{name}-out"
        preprocess([str(data)], out=out, dataset=described, workers=2, chunk_rows=64)
        assert read_split(out).equals(read_split(reference)), name
        stats = json.loads((out / "stats.json").read_text())["files"][0]
        assert (stats["rows_read"], stats.get("blank_lines", 0)) == (300, blank), name
    bad = body[:]
    bad[250] = bad[250].replace(rows["year"][250], "19x9", 1)
    data = tmp_path / "bad.csv"
    data.write_text("\n".join([header, *bad[:100], "", *bad[100:]]) + "\n")
    with pytest.raises(UserError, match=r"bad.csv: line 253: column year: not a number: '19x9'"):
        preprocess([str(data)], out=tmp_path / "bad-out", dataset=described, workers=2, chunk_rows=64)


def test_bad_rows_are_named_by_file_line_and_column_or_skipped_and_accounted(tmp_path):
    rows = movie_rows(200, seed=5)
    data = write_csv(tmp_path / "m.csv", rows)
    text = (tmp_path / "m.csv").read_bytes().split(b"\n")
    text[3] = b"u1,7"  # wrong field count (line 4)
    text[10] = text[10].rsplit(b",", 1)[0] + b",2"  # label not 0/1 (line 11)
    text[20] = text[20].replace(b"u", b"\xff", 1)  # not UTF-8 (line 21)
    fields = text[30].split(b",")
    fields[4] = b"cheap"  # price not a number (line 31)
    text[30] = b",".join(fields)
    (tmp_path / "m.csv").write_bytes(b"\n".join(text))
    described = write_description(tmp_path / "m.yaml")
    with pytest.raises(UserError, match=r"m.csv: line 4: expected 7 fields, found 2"):
        preprocess([data], out=tmp_path / "out", dataset=described, workers=2, chunk_rows=50)
    summary = preprocess([data], out=tmp_path / "out", dataset=described, workers=2, chunk_rows=50,
                         on_bad_rows="skip")
    assert (summary["rows_read"], summary["rows_written"], summary["rows_rejected"]) == (200, 196, 4)
    rejected = (tmp_path / "out" / "rejected.tsv").read_text(encoding="utf-8").splitlines()[1:]
    assert [line.split("\t")[1:3] for line in rejected] == [
        ["4", "expected 7 fields, found 2"], ["11", "column liked: the label must be 0 or 1, got '2'"],
        ["21", "column userId: not valid UTF-8"], ["31", "column price: not a number: 'cheap'"]]
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert all(f["rows_read"] == f["rows_written"] + f["rows_rejected"] for f in stats["files"])


def test_every_row_rejected_is_an_error_and_nothing_is_published(tmp_path, capsys):
    data = tmp_path / "m.csv"
    data.write_text("userId,movieId,genres,year,price,title,liked\n" + "u1,2,,1999,1,t,7\n" * 5)
    code = main(["preprocess", "--dataset", write_description(tmp_path / "m.yaml"), "--train", str(data),
                 "--out", str(tmp_path / "out"), "--on-bad-rows", "skip", "--tracking-uri", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "every input row was rejected (5 read, 0 written" in err and "m.csv: line 2: column liked" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_a_dataset_without_dense_or_without_categorical_columns_works(tmp_path):
    rows = movie_rows(120, seed=6)
    data = write_csv(tmp_path / "m.csv", rows)
    only_sparse = preprocess([data], out=tmp_path / "sparse", workers=1,
                             dataset=write_description(tmp_path / "s.yaml", dense=[], transform=None))
    assert Schema.load(tmp_path / "sparse").features.num_dense == 0 and only_sparse["rows_written"] == 120
    preprocess([data], out=tmp_path / "dense", workers=1,
               dataset=write_description(tmp_path / "d.yaml", categorical=[], multi_hot={}, freq_threshold=None))
    schema = Schema.load(tmp_path / "dense")
    assert schema.features.sparse == () and read_split(tmp_path / "dense").column_names == ["label", "year", "price"]


def test_valid_files_and_the_fan_out_give_the_single_run(tmp_path):
    rows = [movie_rows(250, seed=s) for s in (7, 8, 9)]
    paths = [write_csv(tmp_path / f"day{i}.csv", r) for i, r in enumerate(rows)]
    described = write_description(tmp_path / "m.yaml")
    reference = tmp_path / "single"
    preprocess(paths[:2], paths[2:], out=reference, dataset=described, workers=2, chunk_rows=80)
    assert Schema.load(reference).rows == {"train": 500, "valid": 250}
    counts, parts = [], []
    for i, path in enumerate(paths):
        counts.append(str(tmp_path / f"c{i}"))
        split = "valid" if i == 2 else "train"
        assert main(["preprocess", "count", "--dataset", described, "--input", path, "--file-index", str(i),
                     "--split", split, "--chunk-rows", "80", "--out", counts[-1]]) == 0
    assert main(["preprocess", "merge", "--counts", *counts, "--out", str(tmp_path / "m")]) == 0
    for i, path in enumerate(paths):
        parts.append(str(tmp_path / f"p{i}"))
        split = "valid" if i == 2 else "train"
        assert main(["preprocess", "transform", "--input", path, "--file-index", str(i), "--split", split,
                     "--chunk-rows", "80", "--vocab", str(tmp_path / "m"), "--out", parts[-1]]) == 0
    out = tmp_path / "fanned"
    assert main(["preprocess", "finalize", "--counts", *counts, "--vocab", str(tmp_path / "m"),
                 "--parts", *parts, "--out", str(out)]) == 0
    for split in ("train", "valid"):
        names = sorted(p.name for p in (reference / split).glob("part-*.parquet"))
        assert names and names == sorted(p.name for p in (out / split).glob("part-*.parquet"))
        assert all((out / split / n).read_bytes() == (reference / split / n).read_bytes() for n in names)
    mine, theirs = Schema.load(out), Schema.load(reference)
    assert (mine.vocab_hash, mine.features, mine.dataset, mine.label_rate) == \
        (theirs.vocab_hash, theirs.features, theirs.dataset, theirs.label_rate)


def test_the_gpu_engine_refuses_a_described_table(tmp_path, capsys):
    data = write_csv(tmp_path / "m.csv", movie_rows(20))
    code = main(["preprocess", "--dataset", write_description(tmp_path / "m.yaml"), "--train", data,
                 "--out", str(tmp_path / "out"), "--engine", "gpu", "--tracking-uri", "none"])
    assert code == 2 and "--engine gpu reads only the raw Criteo TSV" in capsys.readouterr().err


def test_criteo_rows_described_as_a_table_match_the_criteo_engine(tmp_path):
    from tests.fixtures.preprocess import random_rows, write

    from ctrflow.contract.catalog import describe

    src = write(tmp_path / "in.tsv", random_rows(600, seed=11))
    described = tmp_path / "criteo.json"
    described.write_text(json.dumps({**describe("criteo").to_dict(), "name": "criteo-as-table"}))
    preprocess([src], out=tmp_path / "engine", freq_threshold=2, workers=2, chunk_rows=150)
    preprocess([src], out=tmp_path / "table", dataset=str(described), freq_threshold=2, workers=2, chunk_rows=150)
    assert pq.read_table(tmp_path / "table" / "train").equals(pq.read_table(tmp_path / "engine" / "train"))
    assert Schema.load(tmp_path / "table").vocab_hash == Schema.load(tmp_path / "engine").vocab_hash
    assert Schema.load(tmp_path / "engine").dataset["name"] == "criteo"


def test_a_parquet_table_with_bad_rows_names_the_row(tmp_path):
    rows = movie_rows(100, seed=12)
    path = write_parquet(tmp_path / "m.parquet", rows, row_group_size=30)
    table = pq.read_table(path)
    labels = table.column("liked").to_pylist()
    labels[41] = 3
    pq.write_table(table.set_column(6, "liked", pa.array(labels, pa.int8())), path, row_group_size=30)
    described = write_description(tmp_path / "m.yaml", format="parquet")
    with pytest.raises(UserError, match=r"m.parquet: row 42: column liked: the label must be 0 or 1, got 3"):
        preprocess([path], out=tmp_path / "out", dataset=described)
    summary = preprocess([path], out=tmp_path / "out", dataset=described, on_bad_rows="skip")
    assert (summary["rows_written"], summary["rows_rejected"]) == (99, 1)


def test_a_stray_quote_in_an_unused_column_gives_the_same_rows(tmp_path):
    rows = movie_rows(300, seed=13)
    rows["title"] = [f'{i}" pizza' if i % 7 == 0 else f"Movie {i}, part {i % 3}" for i in range(300)]
    data = write_csv(tmp_path / "m.csv", rows)
    text = (tmp_path / "m.csv").read_text()
    (tmp_path / "m.csv").write_text(text.replace('"0"" pizza"', '0" pizza').replace('"7"" pizza"', '7" pizza'))
    described = write_description(tmp_path / "m.yaml")
    preprocess([data], out=tmp_path / "one", dataset=described, workers=1)
    preprocess([data], out=tmp_path / "many", dataset=described, workers=2, chunk_rows=20)
    assert read_split(tmp_path / "many").equals(read_split(tmp_path / "one"))
    assert len(read_split(tmp_path / "one")) == 300


def test_the_command_process_keeps_pandas_out_and_exits_with_everything_written(tmp_path):
    """`ctrflow preprocess --dataset FILE` as its own process: pyarrow runs without pandas (never imported),
    the process ends without tearing the interpreter down, the earlier output it replaces is deleted
    after it, and the output equals the library call's."""
    import os
    import subprocess
    import sys
    import time

    rows = movie_rows(300, seed=9)
    data = write_csv(tmp_path / "m.csv", rows)
    described = write_description(tmp_path / "m.yaml")
    reference = tmp_path / "reference"
    preprocess([data], out=reference, dataset=described, workers=2, valid_fraction=0.2)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-X", "importtime", "-m", "ctrflow", "preprocess", "--dataset", described, "--train",
               data, "--valid-fraction", "0.2", "--workers", "2", "--tracking-uri", "none"]
    out = tmp_path / "out"
    preprocess([data], out=out, dataset=described, workers=1, chunk_rows=70)  # an earlier output, replaced
    done = subprocess.run([*command, "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    deadline = time.monotonic() + 30
    while list(tmp_path.glob("out.*")) and time.monotonic() < deadline:  # deleted by a process of its own
        time.sleep(0.05)
    assert not list(tmp_path.glob("out.*")) and Schema.load(out).rows == Schema.load(reference).rows
    assert json.loads(done.stdout.splitlines()[-1])["rows"] == Schema.load(reference).rows
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "pyarrow" in imported and not any(name.startswith("pandas.") for name in imported)
    for split in ("train", "valid"):
        assert read_split(out, split).equals(read_split(reference, split))
    assert Schema.load(out).vocab_hash == Schema.load(reference).vocab_hash
    lines = (tmp_path / "m.csv").read_text().split("\n")
    fields = lines[6].split(",", 4)
    lines[6] = ",".join([*fields[:3], "1999x", fields[4]])  # a year that is not a number, line 7
    (tmp_path / "m.csv").write_text("\n".join(lines))
    failed = subprocess.run([*command, "--out", str(tmp_path / "bad")], env=env, capture_output=True, text=True,
                            timeout=300)
    errors = [line for line in failed.stderr.splitlines() if not line.startswith("import time:")]
    assert failed.returncode == 2 and len(errors) == 1, failed.stderr[-2000:]
    assert "m.csv: line 7: column year: not a number: '1999x'" in errors[0]
    assert not (tmp_path / "bad").exists()
