"""Blocks of whole CSV rows: quoted delimiters and newlines, blank lines, CRLF, stray quotes."""

from __future__ import annotations

import csv
import io

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pytest

from ctrflow.contract.formats.text_rows import Dialect, find_records, iter_blocks, read_header, scan_quotes

DIALECT = Dialect(b",", b'"')


def random_csv(rows: int, seed: int, newline: str = "\n") -> tuple[bytes, list[list[str]], list[int]]:
    """(file bytes, its rows, the line each row starts on): fields with delimiters, quotes, newlines."""
    rng = np.random.default_rng(seed)
    pieces = ["a", "bc", "d,e", 'say "hi"', "two\nlines", "", "x y", "3.5"]
    out, table, lines, line = io.StringIO(), [], [], 1
    writer = csv.writer(out, lineterminator=newline)
    for _ in range(rows):
        if rng.random() < 0.05:
            out.write(newline)  # a blank line: no row
            line += 1
        row = [str(rng.choice(pieces)) for _ in range(3)]
        writer.writerow(row)
        table.append(row)
        lines.append(line)
        line += 1 + sum(field.count("\n") for field in row)
    return out.getvalue().encode(), table, lines


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_blocks_cut_at_row_ends_and_rows_know_their_lines(newline):
    data, rows, lines = random_csv(400, seed=1, newline=newline)
    assert scan_quotes(data, DIALECT).clean
    blocks = list(iter_blocks(data, 0, 97, DIALECT))  # tiny blocks: many cuts near quoted newlines
    cuts = [b for b, *_ in blocks] + [blocks[-1][1]]
    found, found_lines, base = [], [], 0
    for start, end in zip(cuts, cuts[1:]):
        block = data[start:end]
        records = find_records(block, DIALECT)
        parsed = pcsv.read_csv(pa.BufferReader(block), read_options=pcsv.ReadOptions(
            column_names=["a", "b", "c"], use_threads=False), parse_options=pcsv.ParseOptions(newlines_in_values=True),
            convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in "abc"},
                                                strings_can_be_null=False))
        assert len(parsed) == len(records.starts)
        found += [list(r.values()) for r in parsed.to_pylist()]
        found_lines += (records.lines + base + 1).tolist()
        base += records.line_count
    assert found == rows and found_lines == lines
    assert find_records(data, DIALECT, clean=False).lines.tolist() == [n - 1 for n in lines]


def test_a_stray_quote_makes_the_file_split_by_the_csv_module():
    text = 'a,b\n1,12" pizza\n2,"x\ny"\n3,plain\n'.encode()
    scan = scan_quotes(text, DIALECT, 4)
    assert not scan.clean and text[scan.stray:scan.stray + 1] == b'"'
    blocks = list(iter_blocks(text, 4, 5, DIALECT))
    assert [text[a:b] for a, b, _, _ in blocks] == [b'1,12" pizza\n', b'2,"x\ny"\n', b"3,plain\n"]
    assert not any(clean for *_, clean in blocks)
    records = find_records(text[4:], DIALECT, clean=False)
    assert records.lines.tolist() == [0, 1, 3] and records.blank_lines == 0


def test_the_header_may_hold_quotes_and_a_byte_order_mark():
    text = b'\xef\xbb\xbf"user id","genres"\n1,"a|b"\n'
    names, end = read_header(text, DIALECT, scan_quotes(text, DIALECT, 3))
    assert names == ["user id", "genres"] and text[end:] == b'1,"a|b"\n'


def test_blocks_cut_while_scanning_survive_a_late_stray_quote(monkeypatch):
    from ctrflow.contract.formats import text_rows

    monkeypatch.setattr(text_rows, "_PIECE_BYTES", 256)  # quotes counted per piece: many pieces
    data, rows, _ = random_csv(600, seed=3)
    blocks = list(iter_blocks(data, 0, 200, DIALECT))
    cuts = [b for b, *_ in blocks] + [blocks[-1][1]]
    assert all(clean for *_, clean in blocks) and len(blocks) > 10
    assert all(quoted == (b'"' in data[a:b]) for a, b, quoted, _ in blocks)
    stray = cuts[len(cuts) // 2]  # a row end half way: there a row with a quote inside an unquoted field
    broken = data[:stray] + b'x,12" pizza,y\n' + data[stray:]
    parts = list(iter_blocks(broken, 0, 200, DIALECT))
    assert parts[0][3] and not parts[-1][3]  # parity before the stray, the csv module after it
    assert [a for a, *_ in parts[1:]] == [b for _, b, *_ in parts[:-1]] and parts[-1][1] == len(broken)
    expected = rows[:sum(1 for r in csv.reader(io.StringIO(data[:stray].decode())) if r)] + [["x", '12" pizza', "y"]]
    got = []
    for a, b, _, _ in parts:
        got += [list(r) for r in csv.reader(io.StringIO(broken[a:b].decode())) if r]
    assert got[:len(expected)] == expected and len(got) == len(rows) + 1
