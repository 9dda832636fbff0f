"""What a user's own table trips over: empty inputs, another format's delimiter, list separators and
lengths, the row split (`ctrflow preprocess --dataset FILE`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from ctrflow.cli import main
from ctrflow.contract.schema import Schema
from ctrflow.contract.transform import transform_raw
from ctrflow.contract.vocab import load_vocabularies
from tests.fixtures.tables import movie_rows, read_split, write_csv, write_description


def run_preprocess(tmp_path, description: str, *inputs: str, extra: tuple[str, ...] = ()) -> int:
    return main(["preprocess", "--dataset", description, "--train", *inputs, "--out", str(tmp_path / "out"),
                 "--workers", "1", *extra])


@pytest.mark.parametrize("content,problem", [(b"", "the file is empty (0 rows)"), (b"\n\n", "the file is empty (0 rows)"),
                                             (b"liked,userId,movieId\n", "a header and no rows"),
                                             (b"\xef\xbb\xbfliked,userId\r\n\r\n", "a header and no rows")])
def test_an_input_without_rows_is_a_one_line_error_naming_it(tmp_path, capsys, content, problem):
    description = write_description(tmp_path / "movies.yaml")
    good = write_csv(tmp_path / "good.csv", movie_rows(50))
    for name, data in (("in.csv", content), ("in.csv.gz", gzip.compress(content))):
        (tmp_path / name).write_bytes(data)
        assert run_preprocess(tmp_path, description, good, str(tmp_path / name)) == 2
        err = capsys.readouterr().err
        assert err == f"ctrflow preprocess: error: {tmp_path / name}: {problem}: nothing to read\n"
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_a_criteo_input_without_rows_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "day_0.tsv").write_bytes(b"")
    assert main(["preprocess", "--train", str(tmp_path / "day_0.tsv"), "--out", str(tmp_path / "out"),
                 "--workers", "1"]) == 2
    assert capsys.readouterr().err.startswith(f"ctrflow preprocess: error: {tmp_path / 'day_0.tsv'}: the file is empty")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt,delimiter,hint", [("csv", "\t", "the header holds tabs: is the file TSV? set format: tsv"),
                                                ("tsv", ",", "the header holds commas: is the file CSV? set format: csv")])
def test_a_header_in_another_formats_delimiter_says_so(tmp_path, capsys, fmt, delimiter, hint):
    description = write_description(tmp_path / "movies.yaml", format=fmt)
    rows = movie_rows(20)
    del rows["title"]  # no value holding the delimiter
    data = write_csv(tmp_path / "in.txt", rows, delimiter)
    assert run_preprocess(tmp_path, description, data) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ctrflow preprocess: error: {description}: column 'liked' (label) is not in {data}'s header: "
                          f"{hint}") and err.count("\n") == 1


def history_rows(n: int) -> dict[str, list]:
    """A click log: a user's history as a space-separated list of up to 9 article ids, oldest first."""
    rng = np.random.default_rng(3)
    histories = [" ".join(f"a{v}" for v in rng.integers(0, 12, rng.integers(0, 10))) for _ in range(n)]
    return {"clicked": [str(v) for v in (rng.random(n) < 0.2).astype(int)],
            "user": [f"u{v}" for v in rng.integers(0, 30, n)], "history": histories}


def history_description(tmp_path, **options) -> str:
    return write_description(tmp_path / "news.yaml", format="tsv", label="clicked", dense=[], categorical=["user"],
                             multi_hot={"history": {"separator": " ", **options}}, freq_threshold=1, transform=None)


def test_max_length_defaults_to_the_longest_training_list_and_is_recorded(tmp_path):
    rows = history_rows(300)
    data = write_csv(tmp_path / "news.tsv", rows, "\t")
    assert run_preprocess(tmp_path, history_description(tmp_path), data, extra=("--valid-fraction", "0.2")) == 0
    schema = Schema.load(tmp_path / "out")
    train = read_split(tmp_path / "out")
    longest = max(len(h.split()) for h in rows["history"])
    assert schema.dataset["multi_hot"]["history"] == {"separator": " ", "max_length": longest, "pooling": "sum",
                                                      "keep": "first"}
    assert schema.features.sparse[1].max_length == longest
    assert train.schema.field("history").type.list_size == longest
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["columns"]["history"]["truncated_rows"] == 0  # no training list is cut


@pytest.mark.parametrize("keep", ["first", "last"])
def test_keep_first_or_last_cuts_long_lists_alike_in_preprocess_and_serving(tmp_path, keep):
    rows = history_rows(300)
    data = write_csv(tmp_path / "news.tsv", rows, "\t")
    assert run_preprocess(tmp_path, history_description(tmp_path, max_length=3, keep=keep), data) == 0
    out = tmp_path / "out"
    ids = read_split(out).column("history").to_pylist()
    vocab = {v: i + 2 for i, v in enumerate(pq.read_table(out / "vocab" / "history.parquet").column("value").to_pylist())}
    for text, got in zip(rows["history"], ids):
        values = text.split()
        kept = values[:3] if keep == "first" else values[-3:]
        assert got == [vocab.get(v, 1) for v in kept] + [0] * (3 - len(kept))
    schema = Schema.load(out)
    _, sparse = transform_raw({"user": rows["user"], "history": rows["history"]}, schema, load_vocabularies(out))
    assert sparse[:, 1:].tolist() == ids  # serving and predict cut the same values
    stats = json.loads((out / "stats.json").read_text())
    assert stats["columns"]["history"]["truncated_rows"] == sum(len(h.split()) > 3 for h in rows["history"])


def test_lists_that_never_split_warn_naming_the_likely_separator(tmp_path, capsys):
    rows = history_rows(200)
    data = write_csv(tmp_path / "news.tsv", rows, "\t")
    description = history_description(tmp_path, separator="|")  # the docs' default: wrong for this file
    assert run_preprocess(tmp_path, description, data) == 0
    err = capsys.readouterr().err
    assert err == (f"ctrflow preprocess: warning: {description}: multi_hot history: no row's list holds more than one "
                   "value split at '|', but its values hold ' ': is the separator ' '? (set multi_hot: history: "
                   "separator)\n")
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["warnings"] == [err.split("warning: ", 1)[1][:-1]]
    rows["history"] = [h.replace(" ", "|") for h in rows["history"]]
    (tmp_path / "out2").mkdir()
    write_csv(tmp_path / "news.tsv", rows, "\t")
    assert run_preprocess(tmp_path / "out2", description, data) == 0
    assert capsys.readouterr().err == ""


def test_valid_fraction_splits_the_same_rows_whatever_the_line_endings_or_a_bom(tmp_path):
    rows = movie_rows(2000, seed=4)
    text = Path(write_csv(tmp_path / "m.csv", rows)).read_text()
    variants = {"lf": text.encode(), "crlf": text.replace("\n", "\r\n").encode(),
                "bom": b"\xef\xbb\xbf" + text.encode()}
    description = write_description(tmp_path / "movies.yaml")
    splits = {}
    for name, data in variants.items():
        (tmp_path / f"{name}.csv").write_bytes(data)
        assert main(["preprocess", "--dataset", description, "--train", str(tmp_path / f"{name}.csv"), "--out",
                     str(tmp_path / name), "--workers", "1", "--valid-fraction", "0.2", "--seed", "7"]) == 0
        splits[name] = (read_split(tmp_path / name), read_split(tmp_path / name, "valid"))
    train, valid = splits["lf"]
    assert len(train) + len(valid) == 2000 and 330 < len(valid) < 470
    for name in ("crlf", "bom"):
        assert splits[name][0].equals(train) and splits[name][1].equals(valid)
