"""What a user's own table trips over: empty inputs, another format's delimiter, list separators and
lengths, the row split (`ctrflow preprocess --dataset FILE`)."""

from __future__ import annotations

import gzip

import pytest

from ctrflow.cli import main
from tests.fixtures.tables import movie_rows, write_csv, write_description


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
