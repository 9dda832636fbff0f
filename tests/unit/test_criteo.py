"""The raw Criteo reader: blocks of whole lines, exact line numbers, validation, gzip."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pytest

from ctrflow.contract.formats.files import expand_inputs
from ctrflow.ingest.blocks import plan_blocks, read_block
from ctrflow.ingest.criteo.raw import count_lines, parse_block, parse_integers, read_raw
from ctrflow.contract.vocab import encode_keys, keys_to_strings
from ctrflow.errors import UserError


def lines_of(path, block_bytes):
    blocks = list(plan_blocks(path, 0, block_bytes))
    return b"".join(bytes(read_block(path, b)[1]) for b in blocks), blocks


@pytest.mark.parametrize("block_bytes", [3, 64, 1000, 10**6])
def test_blocks_cover_every_line_exactly_once(tmp_path, block_bytes):
    text = b"".join(b"x" * (i % 37) + b"\n" for i in range(300)) + b"last line without newline"
    path = tmp_path / "f.tsv"
    path.write_bytes(text)
    joined, blocks = lines_of(path, block_bytes)
    assert joined == text
    assert sum(count_lines(read_block(path, b)[1]) for b in blocks) == 301
    starts = [read_block(path, b)[0] for b in blocks if len(read_block(path, b)[1])]
    assert all(s == 0 or text[s - 1:s] == b"\n" for s in starts)


def test_gzip_blocks_are_whole_lines_and_members_concatenate(tmp_path):
    text = b"".join(b"%d\tabc\n" % i for i in range(5000))
    path = tmp_path / "f.gz"
    path.write_bytes(gzip.compress(text[:20000]) + gzip.compress(text[20000:]))
    blocks = list(plan_blocks(path, 0, 4096))
    assert len(blocks) > 3 and all(b.data.endswith(b"\n") for b in blocks)
    assert b"".join(b.data for b in blocks) == text and not any(b.truncated for b in blocks)


def test_truncated_gzip_ends_with_a_marker(tmp_path):
    line = "\t".join(["1"] + ["2"] * 13 + ["68fd1e64"] * 26).encode() + b"\n"
    data = gzip.compress(line * 5000)
    path = tmp_path / "cut.gz"
    path.write_bytes(data[: len(data) // 2])
    blocks = list(plan_blocks(path, 0, 1 << 14))
    assert blocks[-1].truncated and not any(b.truncated for b in blocks[:-1])
    assert b"\n" not in blocks[-1].data
    with pytest.raises(UserError, match=r"cut\.gz: (after )?line \d+: truncated gzip"):
        list(read_raw(path, block_bytes=1 << 14))


def test_parse_integers_names_bad_positions():
    values, bad = parse_integers(pa.array(["1", "", "-3", "x", " 7 ", "2.5", "99999999999999999999"]))
    assert values.to_pylist() == [1, None, -3, None, 7, None, None] and bad == [3, 5, 6]


def test_parse_block_reports_every_problem_with_its_line():
    good = "\t".join(["1"] + ["2"] * 13 + ["68fd1e64"] * 26)
    bad_label = "\t".join(["x"] + ["2"] * 13 + [""] * 26)
    data = "\n".join([good, "short\tline", bad_label, good]).encode() + b"\n"
    parsed = parse_block(data)
    assert parsed.lines == 4 and parsed.rows.tolist() == [0, 3]
    assert [(p[0], p[1].split(":")[0]) for p in parsed.problems] == [(1, "expected 40 tab-separated fields, found 2"),
                                                                      (2, "label")]
    assert parsed.label.tolist() == [1, 1] and parsed.dense[0].to_pylist() == [2, 2]


def test_read_raw_reads_the_test_layout(criteo_dir):
    blocks = list(read_raw(criteo_dir / "test_head_100.txt", with_label=False))
    assert sum(len(b.rows) for b in blocks) == 100 and blocks[0].label is None


def test_keys_round_trip_to_strings():
    keys, other = encode_keys(pa.chunked_array([["68fd1e64", "", "abc"], ["05db9164"]]))
    assert other.to_pylist() == [None, None, "abc", None]
    assert keys_to_strings(keys[keys != 0]).to_pylist() == ["68fd1e64", "05db9164"]
    assert keys[1] == 0 and keys[2] == 0 and np.unique(keys).size == 3


def test_expand_inputs_globs_and_missing_files(tmp_path):
    for name in ("b.tsv", "a.tsv"):
        (tmp_path / name).write_text("")
    assert [p.name for p in expand_inputs([str(tmp_path / "*.tsv")])] == ["a.tsv", "b.tsv"]
    with pytest.raises(UserError, match="no file matches"):
        expand_inputs([str(tmp_path / "*.gz")])
    with pytest.raises(UserError, match="no such file"):
        expand_inputs([str(tmp_path / "nope.tsv")])
