"""The raw Criteo format: find input files, cut them into blocks of whole lines, parse and validate blocks.

A row is one line of tab-separated fields: label, I1..I13 (integers, may be negative or empty),
C1..C26 (usually 8 hex digits, or empty). Kaggle's test layout has no label (39 fields).
Files may be gzip. Blocks are cut on newline boundaries so every row keeps an exact line number:
plain files are cut by byte range (each worker reads its own range), gzip files are decompressed
in order by one reader. Parsing is pyarrow's CSV reader; only a block that fails the fast, typed
parse is re-checked line by line to name each bad row.
"""

from __future__ import annotations

import glob
import mmap
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from ctrflow.data.schema import DENSE, LABEL, RAW_COLUMNS, SPARSE
from ctrflow.errors import UserError

TEST_COLUMNS = (*DENSE, *SPARSE)  # Kaggle test layout: no label
GZIP_MAGIC = b"\x1f\x8b"
_READ_BYTES = 1 << 20


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Input files in the order given; glob patterns expand sorted. Missing or unreadable files raise."""
    paths: list[Path] = []
    for pattern in patterns:
        text = str(pattern)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise UserError(f"{text}: no file matches this pattern")
            paths.extend(Path(m) for m in matches)
        else:
            paths.append(Path(text))
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: no such file")
        if not os.access(path, os.R_OK):
            raise UserError(f"{path}: not readable (permission denied)")
    return paths


def is_gzip(path: str | os.PathLike) -> bool:
    """True when the file starts with the gzip magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


@dataclass(frozen=True)
class Block:
    """A run of whole lines of one input file: a byte range to read, or (gzip) the lines themselves."""

    file_index: int
    index: int  # order within its file
    start: int  # uncompressed byte offset where the block's range begins
    end: int = 0  # plain files: the worker reads the lines starting in [start, end)
    data: bytes | None = None  # gzip: decompressed whole lines, read in order by the main process
    truncated: bool = False  # gzip stream ended early: `data` is the incomplete last line (may be empty)


def plan_blocks(path: Path, file_index: int, block_bytes: int) -> Iterator[Block]:
    """The blocks of one file, in order."""
    if is_gzip(path):
        yield from _gzip_blocks(path, file_index, block_bytes)
        return
    size = path.stat().st_size
    for index, start in enumerate(range(0, size, block_bytes)):
        yield Block(file_index, index, start, min(start + block_bytes, size))


def read_block(path: Path, block: Block) -> tuple[int, bytes | memoryview]:
    """(byte offset of the first line, the lines starting inside the block's range, newlines included)."""
    if block.data is not None:
        return block.start, block.data
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # no copy: pyarrow parses in place
    size = len(mapped)
    begin = block.start
    if begin > 0:  # a line starts at `start` only when the byte before it is a newline
        newline = mapped.find(b"\n", begin - 1)
        begin = size if newline < 0 else newline + 1
    if begin >= block.end:
        return begin, b""
    newline = mapped.find(b"\n", block.end - 1)  # the last line starts inside the range: it belongs here
    stop = size if newline < 0 else newline + 1
    return begin, memoryview(mapped)[begin:stop]


def _gzip_blocks(path: Path, file_index: int, block_bytes: int) -> Iterator[Block]:
    """Decompress (multi-member) gzip, cutting blocks after a newline; a truncated stream ends with a marker."""
    buf = bytearray()
    offset, index = 0, 0
    decomp = zlib.decompressobj(31)
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            try:
                while chunk:
                    buf += decomp.decompress(chunk)
                    chunk = b""
                    if decomp.eof and decomp.unused_data:  # concatenated gzip members
                        chunk, decomp = decomp.unused_data, zlib.decompressobj(31)
            except zlib.error as err:
                raise UserError(f"{path}: corrupt gzip data near uncompressed byte {offset + len(buf)} ({err})")
            while len(buf) >= block_bytes and (cut := buf.find(b"\n", block_bytes - 1) + 1):
                yield Block(file_index, index, offset, data=bytes(buf[:cut]))
                offset, index = offset + cut, index + 1
                del buf[:cut]
    if decomp.eof:
        if buf:
            yield Block(file_index, index, offset, data=bytes(buf))
        return
    if cut := buf.rfind(b"\n") + 1:
        yield Block(file_index, index, offset, data=bytes(buf[:cut]))
        offset, index = offset + cut, index + 1
    yield Block(file_index, index, offset, data=bytes(buf[cut:]), truncated=True)


def count_lines(data: bytes | memoryview) -> int:
    """Lines in a block: newlines, plus an unterminated last line."""
    if not len(data):
        return 0
    raw = np.frombuffer(data, dtype=np.uint8)
    return int(np.count_nonzero(raw == 10)) + (0 if raw[-1] == 10 else 1)


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


def _options(names: Sequence[str], typed: bool):
    types = {c: (pa.int64() if typed else pa.string()) for c in names if c not in SPARSE}
    types.update({c: pa.string() for c in names if c in SPARSE})
    return dict(
        read_options=pcsv.ReadOptions(column_names=list(names), use_threads=False, block_size=2 << 20),
        parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
        convert_options=pcsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False,
                                            quoted_strings_can_be_null=False),
    )


def _read(data: bytes | memoryview, names: Sequence[str], typed: bool) -> pa.Table:
    return pcsv.read_csv(pa.BufferReader(data), **_options(names, typed))


def parse_block(data: bytes | memoryview, with_label: bool = True) -> ParsedBlock:
    """Parse a block of raw lines; bad rows are listed in `problems`, never silently dropped."""
    names = RAW_COLUMNS if with_label else TEST_COLUMNS
    lines = count_lines(data)
    if lines == 0:
        return _to_parsed(None, names, 0, np.zeros(0, np.int64), [])
    try:
        table = _read(data, names, typed=True)
        if len(table) == lines and (not with_label or _labels_ok(table.column(LABEL))):
            return _to_parsed(table, names, lines, np.arange(lines, dtype=np.int64), [])
    except (pa.ArrowInvalid, UnicodeDecodeError):
        pass
    return _parse_slowly(data, names, lines)


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


def _parse_slowly(data: bytes, names: Sequence[str], lines: int) -> ParsedBlock:
    """Name every bad line: field count and UTF-8 per line, then label and dense values per column."""
    raw_lines = bytes(data).split(b"\n")[:lines]
    problems: list[tuple[int, str, bytes]] = []
    good: list[int] = []
    for i, line in enumerate(raw_lines):
        n = line.count(b"\t") + 1
        if n != len(names):
            problems.append((i, f"expected {len(names)} tab-separated fields, found {n}", line))
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


def read_raw(path: str | os.PathLike, with_label: bool = True, block_bytes: int = 64 << 20) -> Iterator[ParsedBlock]:
    """Parse a raw file block by block (in one process); the first bad row raises `UserError` with file:line."""
    path = Path(path)
    first_line = 1
    for block in plan_blocks(path, 0, block_bytes):
        _, data = read_block(path, block)
        if block.truncated:
            raise UserError(truncation_message(path, first_line + count_lines(data) - 1, data))
        parsed = parse_block(data, with_label)
        if parsed.problems:
            line, reason, _ = parsed.problems[0]
            raise UserError(f"{path}: line {first_line + line}: {reason}")
        first_line += parsed.lines
        yield parsed


def truncation_message(path: Path, line: int, tail: bytes) -> str:
    """The one-line error for a gzip stream that ends early."""
    where = f"line {line}" if tail else f"after line {line}"
    return f"{path}: {where}: truncated gzip file (the compressed stream ends early)"
