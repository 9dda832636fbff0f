"""Parsing and validating blocks of raw Criteo lines (see `criteo` for the format and the blocks).

The fast path is pyarrow's typed CSV reader on the whole block; only a block that fails it (or whose
row count or labels are off) is re-checked line by line, to name each bad row. The C columns can be
read as binary, with a cheaper UTF-8 check than the reader's (most values are ASCII), and as 8-byte
fixed-size binary when every value of the block is 8 ASCII bytes: then the values are the keys
(`ParsedBlock.keys`, as `vocab.encode_keys` makes them) with no offsets at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from ctrflow.contract.schema import LABEL
from ctrflow.contract.criteo import DENSE, RAW_COLUMNS, SPARSE

TEST_COLUMNS = (*DENSE, *SPARSE)  # Kaggle test layout: no label
_COUNT_BYTES = 1 << 20
_HIGH_BITS = np.uint64(0x8080808080808080)
_FIXED = pa.binary(8)


def count_lines(data: bytes | memoryview) -> int:
    """Lines in a block: newlines, plus an unterminated last line."""
    if not len(data):
        return 0
    raw = np.frombuffer(data, dtype=np.uint8)
    newlines = 0
    for at in range(0, len(raw), _COUNT_BYTES):  # one small temporary reused, not a fresh one per block byte
        newlines += int(np.count_nonzero(raw[at:at + _COUNT_BYTES] == 10))
    return newlines + (0 if raw[-1] == 10 else 1)


def line_starts(data: bytes | memoryview) -> np.ndarray:
    """Byte offset of each line's first byte within the block, int64 [lines]."""
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate(([0], newlines + 1)).astype(np.int64)
    return starts[: count_lines(data)]


@dataclass
class ParsedBlock:
    """The valid rows of one block, column by column, and the problems of the others."""

    lines: int  # lines in the block: rows read
    rows: np.ndarray  # int64 [n]: block-relative line index of each valid row
    label: np.ndarray | None  # int8 [n] (0/1); None for the test layout
    dense: list[pa.ChunkedArray]  # 13 int64 columns, null = missing
    sparse: list[pa.ChunkedArray]  # 26 string columns, "" = missing
    problems: list[tuple[int, str, bytes]] = field(default_factory=list)  # (line index, reason, raw line)
    keys: list[np.ndarray] | None = None  # fixed-size C columns: uint64 [n] each, 0 = missing (`encode_keys`)


def _options(names: Sequence[str], typed: bool, sparse_type: pa.DataType = pa.string()):
    types = {c: (pa.int64() if typed else pa.string()) for c in names if c not in SPARSE}
    types.update({c: sparse_type for c in names if c in SPARSE})
    return dict(
        read_options=pcsv.ReadOptions(column_names=list(names), use_threads=False, block_size=2 << 20),
        parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
        convert_options=pcsv.ConvertOptions(column_types=types, null_values=[""], quoted_strings_can_be_null=False,
                                            strings_can_be_null=sparse_type == _FIXED),  # fixed: "" → null
    )


def _read(data: bytes | memoryview, names: Sequence[str], typed: bool,
          sparse_type: pa.DataType = pa.string()) -> pa.Table:
    return pcsv.read_csv(pa.BufferReader(data), **_options(names, typed, sparse_type))


def parse_block(data: bytes | memoryview, with_label: bool = True, binary: bool = False) -> ParsedBlock:
    """Parse a block of raw lines; bad rows are listed in `problems`, never silently dropped.
    `binary`: C columns as binary, checked to be UTF-8 more cheaply than the reader checks strings
    (most values are ASCII): 8-byte fixed-size binary (null = missing) when every value of the block
    is 8 ASCII bytes (Criteo's hex digits; the keys without offsets), else variable-length binary."""
    names = RAW_COLUMNS if with_label else TEST_COLUMNS
    lines = count_lines(data)
    if lines == 0:
        return _to_parsed(None, names, 0, np.zeros(0, np.int64), [])
    for sparse_type in (_FIXED, pa.binary()) if binary else (pa.string(),):
        try:
            table = _read(data, names, typed=True, sparse_type=sparse_type)
        except (pa.ArrowInvalid, UnicodeDecodeError):
            continue  # fixed: some value is not 8 bytes
        if len(table) != lines or (with_label and not _labels_ok(table.column(LABEL))):
            break
        if sparse_type == _FIXED:
            keys = [_fixed_keys(table.column(c)) for c in SPARSE]
            if all(k is not None for k in keys):
                parsed = _to_parsed(table, names, lines, np.arange(lines, dtype=np.int64), [])
                parsed.keys = keys
                return parsed
        elif sparse_type == pa.string() or all(_utf8_ok(table.column(c)) for c in SPARSE):
            return _to_parsed(table, names, lines, np.arange(lines, dtype=np.int64), [])
    parsed = _parse_slowly(data, names, lines)
    if binary:
        parsed.sparse = [column.cast(pa.binary()) for column in parsed.sparse]
    return parsed


def _utf8_ok(column: pa.ChunkedArray) -> bool:
    """Whether a binary column is valid UTF-8: ASCII bytes (no high bit) are, others are checked by a cast."""
    for chunk in column.chunks:
        _, offsets_buf, data_buf = chunk.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=len(chunk) + 1, offset=chunk.offset * 4)
        begin, size = int(offsets[0]), int(offsets[-1] - offsets[0])
        if size == 0:
            continue
        words = np.frombuffer(data_buf, dtype="<u8", count=size // 8, offset=begin)
        tail = np.frombuffer(data_buf, dtype=np.uint8, count=size % 8, offset=begin + size - size % 8)
        if (np.bitwise_or.reduce(words, initial=np.uint64(0)) & _HIGH_BITS) or (tail >= 0x80).any():
            try:
                chunk.cast(pa.string())
            except pa.ArrowInvalid:
                return False
    return True


def _labels_ok(labels: pa.ChunkedArray) -> bool:
    return labels.null_count == 0 and bool(pc.all(pc.is_in(labels, value_set=pa.array([0, 1]))).as_py())


def _to_parsed(table, names, lines, rows, problems) -> ParsedBlock:
    if table is None:
        return ParsedBlock(lines, rows, np.zeros(0, np.int8) if LABEL in names else None,
                           [pa.array([], pa.int64())] * len(DENSE), [pa.array([], pa.string())] * len(SPARSE), problems)
    label = None
    if LABEL in names:
        label = table.column(LABEL).to_numpy().astype(np.int8)
    dense = [table.column(c) for c in DENSE]  # chunked: concatenating costs more than it saves
    sparse = [table.column(c) for c in SPARSE]
    return ParsedBlock(lines, rows, label, dense, sparse, problems)


def _fixed_keys(column: pa.ChunkedArray) -> np.ndarray | None:
    """A fixed-size column's values as uint64 keys (0 = missing), or None unless every value is ASCII
    (so valid UTF-8), no value is 8 NUL bytes (an "other" value) and the null slots read as 0."""
    words = [np.frombuffer(c.buffers()[1], dtype="<u8", count=len(c), offset=c.offset * 8) for c in column.chunks]
    keys = np.concatenate(words) if words else np.zeros(0, np.uint64)
    high = np.bitwise_or.reduce(keys, initial=np.uint64(0)) & _HIGH_BITS
    return None if high or len(keys) - np.count_nonzero(keys) != column.null_count else keys


def _parse_slowly(data: bytes, names: Sequence[str], lines: int) -> ParsedBlock:
    """Name every bad line: field count and UTF-8 per line, then label and dense values per column."""
    raw_lines = bytes(data).split(b"\n")[:lines]
    problems: list[tuple[int, str, bytes]] = []
    good: list[int] = []
    for i, line in enumerate(raw_lines):
        n = line.count(b"\t") + 1
        if n != len(names):
            problems.append((i, _field_count(len(names), n), line))
            continue
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            problems.append((i, "not valid UTF-8", line))
            continue
        good.append(i)
    rows = np.asarray(good, dtype=np.int64)
    if not good:
        return _to_parsed(None, names, lines, rows, problems)
    table = _read(b"\n".join(raw_lines[i] for i in good) + b"\n", names, typed=False)
    keep = np.ones(len(good), dtype=bool)
    columns: dict[str, pa.Array] = {}
    for name in names:
        if name in SPARSE:
            continue
        values, bad = parse_integers(table.column(name).combine_chunks())
        if name == LABEL:
            bad = sorted(set(bad) | set(np.flatnonzero(~_is_binary(values)).tolist()))
        for pos in bad:
            if keep[pos]:
                keep[pos] = False
                text = table.column(name)[pos].as_py()
                what = "label must be 0 or 1" if name == LABEL else "dense value is not an integer"
                problems.append((good[pos], f"{name}: {what}, got {text!r}", raw_lines[good[pos]]))
        columns[name] = values
    problems.sort(key=lambda p: p[0])
    mask = pa.array(keep)
    typed = pa.table({n: (columns[n] if n in columns else table.column(n)) for n in names}).filter(mask)
    return _to_parsed(typed, names, lines, rows[keep], problems)


def _field_count(expected: int, found: int) -> str:
    reason = f"expected {expected} tab-separated fields, found {found}"
    if expected == len(RAW_COLUMNS) and found == len(TEST_COLUMNS):  # no label: the rows cannot be trained on
        reason += " (Kaggle's unlabelled test layout? preprocessing needs the label as the first field)"
    return reason


def _is_binary(values: pa.Array) -> np.ndarray:
    filled = pc.fill_null(values, -1).to_numpy(zero_copy_only=False)
    return (filled == 0) | (filled == 1)


def parse_integers(strings: pa.Array) -> tuple[pa.Array, list[int]]:
    """Strings → int64 with Arrow's integer grammar (as the CSV reader); "" → null; bad positions listed."""
    trimmed = pc.utf8_trim_whitespace(strings)
    empty = pc.equal(trimmed, "")
    cleaned = pc.if_else(empty, pa.scalar(None, pa.string()), trimmed)
    try:
        return pc.cast(cleaned, pa.int64()), []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    bad = _bad_positions(cleaned, 0)
    ok = np.ones(len(cleaned), dtype=bool)
    ok[bad] = False
    values = pc.cast(pc.if_else(pa.array(ok), cleaned, pa.scalar(None, pa.string())), pa.int64())
    return values, bad


def _bad_positions(strings: pa.Array, offset: int) -> list[int]:
    """Bisect to the elements that do not cast: O(bad × log n) casts."""
    try:
        pc.cast(strings, pa.int64())
        return []
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if len(strings) == 1:
            return [offset]
    mid = len(strings) // 2
    return _bad_positions(strings.slice(0, mid), offset) + _bad_positions(strings.slice(mid), offset + mid)
