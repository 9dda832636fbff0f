"""Where the rows of a CSV/TSV file begin and end, so that blocks of whole rows parse on their own.

A quoted field may hold the delimiter or a newline, so a newline ends a row only outside quotes.
Where every quote character of a file stands where RFC 4180 puts it (an opening quote at the start
of a field, a closing one before a delimiter, a line end or a doubled quote), quoting is a matter of
parity: a newline ends a row when an even number of quotes precede it. That is checked once per file
(`scan_quotes`), vectorized. A file with a quote elsewhere (`12" pizza` in an unquoted field, which
pyarrow's reader takes literally) is split by Python's `csv` module instead: slower, the same rows.

Rows are what pyarrow's reader counts: lines end in \\n, \\r\\n or \\r; empty lines hold no row
(`blank_lines`). Line numbers count physical lines, so a row with quoted newlines spans several and
an error names the line it starts on.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

import numpy as np

from ctrflow.errors import UserError

_SCAN_BYTES = 16 << 20
_PIECE_BYTES = 1 << 20
_LF, _CR = 10, 13
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Dialect:
    """The bytes that delimit fields and quote them (None: no quoting)."""

    delimiter: bytes
    quote: bytes | None

    def csv_options(self) -> dict:
        """The same dialect for Python's `csv` module."""
        if self.quote is None:
            return dict(delimiter=self.delimiter.decode(), quoting=csv.QUOTE_NONE, strict=False)
        return dict(delimiter=self.delimiter.decode(), quotechar=self.quote.decode(), doublequote=True,
                    strict=False)


@dataclass
class QuoteScan:
    """A file's quotes: their count before each 1 MiB piece (the parity anywhere), and whether they all
    stand where RFC 4180 puts them (`clean`; else `stray` is the offset of the first that does not)."""

    prefix: np.ndarray | None  # int64 [pieces + 1]
    clean: bool
    stray: int = -1


class QuoteTracker:
    """A file's quotes from `start` on, scanned piece by piece only as far as asked (`advance_to`): their
    count before any offset (`quotes_before`) and the first quote that is not where RFC 4180 puts it
    (`stray`, -1 while none is found; parity is then trusted only before it)."""

    def __init__(self, data, dialect: Dialect, start: int = 0):
        self.data, self.size, self.start = data, len(data), start
        self.q, self.quote = dialect.quote[0], dialect.quote
        self.beside = np.zeros(256, dtype=bool)  # the bytes a quote may follow (opening) or precede (closing)
        self.beside[[dialect.delimiter[0], _LF, _CR, self.q]] = True
        self.prefix = [0]  # quotes before each piece boundary scanned (from `start`'s piece)
        self.scanned = start  # [start, scanned) is scanned
        self.stray = -1

    def advance_to(self, position: int) -> None:
        """Scan the pieces holding [scanned, position) (stops at a stray quote)."""
        position = min(position, self.size)
        while self.scanned < position and self.stray < 0:
            self._scan_piece()

    def _scan_piece(self) -> None:
        lo = self.scanned
        end = min(lo - lo % _PIECE_BYTES + _PIECE_BYTES, self.size)
        first = max(lo - 1, 0)  # one byte either side: the neighbours of the piece's first and last quotes
        chunk = self.data[first:min(end + 1, self.size)]
        chunk = chunk if isinstance(chunk, bytes) else bytes(chunk)
        shift = lo - first
        if chunk.find(self.quote, shift, shift + end - lo) < 0:  # memchr: most pieces hold no quote
            self.prefix.append(self.prefix[-1])
            self.scanned = end
            return
        window = np.frombuffer(chunk, dtype=np.uint8)
        at = np.flatnonzero(window[shift:shift + end - lo] == self.q).astype(np.int32) + shift
        if len(at):
            prev = self.beside[window[np.maximum(at - 1, 0)]]
            if lo == self.start:
                prev[at == shift] = True  # the data's first byte starts a field
            nxt = self.beside[window[np.minimum(at + 1, len(window) - 1)]]
            if end == self.size:
                nxt[at + 1 >= len(window)] = True  # the last byte ends a field
            opening = (np.arange(len(at)) & 1) == (self.prefix[-1] & 1)
            bad = np.flatnonzero(np.where(opening, ~prev, ~nxt))
            if len(bad):
                self.stray = int(first + at[bad[0]])
                return
        self.prefix.append(self.prefix[-1] + len(at))
        self.scanned = end

    def quotes_before(self, position: int) -> int:
        """Quotes in [start, position): the pieces before `position`'s must be scanned."""
        piece = position // _PIECE_BYTES - self.start // _PIECE_BYTES
        lo = max(self.start, position - position % _PIECE_BYTES)
        return self.prefix[piece] + (self.data[lo:position].count(bytes([self.q])) if position > lo else 0)


def scan_quotes(data, dialect: Dialect, start: int = 0) -> QuoteScan | None:
    """Quote counts and the RFC 4180 check of `data[start:]` (a field starts at `start`), all of it at
    once; None when it holds no quote at all."""
    if dialect.quote is None or data.find(dialect.quote, start) < 0:
        return None
    tracker = QuoteTracker(data, dialect, start)
    tracker.advance_to(len(data))
    if tracker.stray >= 0:
        return QuoteScan(None, False, tracker.stray)
    counts = np.zeros(-(-len(data) // _PIECE_BYTES) + 1, dtype=np.int64)
    counts[start // _PIECE_BYTES + 1:start // _PIECE_BYTES + len(tracker.prefix)] = np.diff(tracker.prefix)
    return QuoteScan(np.cumsum(counts), True)


def _outside_quotes(mapped, scan: QuoteScan, q: bytes, position: int) -> bool:
    piece = position // _PIECE_BYTES
    return (int(scan.prefix[piece]) + mapped[piece * _PIECE_BYTES:position].count(q)) % 2 == 0


def row_end_after(mapped, position: int, dialect: Dialect, scan: QuoteScan | None) -> int:
    """The offset just past the first row-ending newline at or after `position` (a clean or quote-free
    file), or the file's size."""
    while True:
        newline = mapped.find(b"\n", position)
        if newline < 0:
            return len(mapped)
        if scan is None or _outside_quotes(mapped, scan, dialect.quote, newline):
            return newline + 1
        position = newline + 1


def iter_blocks(data, start: int, block_bytes: int, dialect: Dialect):
    """(begin, end, quoted, clean) of each block of whole rows of `data[start:]`, found as the file is
    scanned (so the blocks before a cut can be parsed while the rest is scanned): `quoted`, the block
    holds a quote; `clean`, its quotes are RFC 4180's. From the first stray quote on, Python's csv
    module cuts the rest (`clean` False)."""
    size = len(data)
    tracker = QuoteTracker(data, dialect, start) if dialect.quote is not None else None
    begin = start
    while begin < size:
        end = _next_cut(data, begin, block_bytes, tracker)
        if end is None:  # a stray quote before the cut: parity cannot be trusted from here
            for a, b in _csv_blocks(data, begin, block_bytes, dialect):
                yield a, b, True, False
            return
        quoted = tracker is not None and tracker.quotes_before(end) > tracker.quotes_before(begin)
        yield begin, end, quoted, True
        begin = end


def _next_cut(data, begin: int, block_bytes: int, tracker: QuoteTracker | None) -> int | None:
    """The end of the block starting at `begin` (a row end at or after block_bytes), None at a stray."""
    size = len(data)
    position = begin + block_bytes - 1
    while True:
        newline = data.find(b"\n", position) if position < size else -1
        end = size if newline < 0 else newline + 1
        if tracker is None:
            return end
        tracker.advance_to(end)
        if tracker.stray >= 0:
            return None
        if end == size or tracker.quotes_before(newline) % 2 == 0:
            return end
        position = newline + 1


def _csv_blocks(data, start: int, block_bytes: int, dialect: Dialect):
    """(begin, end) of blocks of whole rows of data[start:] as Python's csv module reads them."""
    size, begin = len(data), start
    for record in _csv_records(data, start, size, dialect):
        if record[2] - begin >= block_bytes:
            yield begin, record[2]
            begin = record[2]
    if begin < size:
        yield begin, size


def read_header(mapped, dialect: Dialect, scan: QuoteScan | None) -> tuple[list[str], int]:
    """(column names, offset where the data rows begin) of a file whose first row names its columns.
    A UTF-8 byte order mark is skipped, as pyarrow's reader skips it."""
    start = len(BOM) if mapped[:len(BOM)] == BOM else 0
    if scan is not None and not scan.clean:
        end = next((r[2] for r in _csv_records(mapped, start, len(mapped), dialect) if not r[3]), len(mapped))
    else:
        end = row_end_after(mapped, start, dialect, scan)
    text = bytes(mapped[start:end]).decode("utf-8", "replace")
    names = next(csv.reader(io.StringIO(text), **dialect.csv_options()), [])
    return names, end


def check_has_rows(path, head: bytes, header_end: int, complete: bool) -> None:
    """A one-line UserError when a file holds no row: 0 bytes, or nothing but its header (`head`: the
    file's first bytes, `complete`: all of them; `header_end`: where the rows begin)."""
    if not complete or head[header_end:].strip(b"\r\n"):
        return
    if not head[len(BOM) if head[:len(BOM)] == BOM else 0:].strip(b"\r\n"):
        raise UserError(f"{path}: the file is empty (0 rows): nothing to read")
    raise UserError(f"{path}: a header and no rows: nothing to read")


@dataclass
class Records:
    """The rows of a block: where each starts and ends (its line end excluded) and the line it starts on."""

    starts: np.ndarray  # int64 [rows]: offsets in the block
    ends: np.ndarray  # int64 [rows]
    lines: np.ndarray  # int64 [rows]: the line (0-based, in the block) each row starts on
    line_count: int  # physical lines in the block
    blank_lines: int


def _line_ends(raw: np.ndarray) -> np.ndarray:
    """bool [n]: the byte ends a line (\\n; \\r not followed by \\n)."""
    ends = raw == _LF
    cr = np.flatnonzero(raw == _CR)
    if len(cr):
        lone = cr[(cr + 1 >= len(raw)) | (raw[np.minimum(cr + 1, len(raw) - 1)] != _LF)]
        ends[lone] = True
    return ends


def count_lines(data, returns: bool = True) -> int:
    """Physical lines of a block: line ends (\\n, \\r\\n, \\r), plus an unterminated last line.
    `returns`: the data may hold carriage returns (False: only \\n to count, one pass)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if not len(raw):
        return 0
    if not returns:
        return int(np.count_nonzero(raw == _LF)) + (0 if raw[-1] == _LF else 1)
    ends = _line_ends(raw)
    return int(np.count_nonzero(ends)) + (0 if ends[-1] else 1)


def find_records(data, dialect: Dialect, clean: bool = True) -> Records:
    """The rows of a block of whole rows, as pyarrow's reader sees them (`clean`: the file's quotes
    are RFC 4180's, so parity tells quoted newlines apart; else Python's csv module splits the rows)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    n = len(raw)
    if not n:
        empty = np.zeros(0, np.int64)
        return Records(empty, empty, empty, 0, 0)
    if not clean:
        return _csv_find_records(raw, dialect)
    ends = _line_ends(raw)
    terminators = np.flatnonzero(ends)
    line_count = len(terminators) + (0 if ends[-1] else 1)
    row_end = np.ones(len(terminators), dtype=bool)
    if dialect.quote is not None and len(terminators):
        quotes = np.flatnonzero(raw == dialect.quote[0])
        row_end = np.searchsorted(quotes, terminators) % 2 == 0  # quotes before the line end: even
    closing = terminators[row_end]
    starts = np.concatenate(([0], closing + 1))
    stops = np.concatenate((closing, [n]))
    lines = np.concatenate(([0], np.flatnonzero(row_end) + 1))
    closed = np.arange(len(stops)) < len(closing)
    crlf = closed & (stops > starts) & (raw[np.maximum(stops - 1, 0)] == _CR) & (raw[np.minimum(stops, n - 1)] == _LF)
    stops = np.where(crlf, stops - 1, stops)
    keep = stops > starts
    blank = int(np.count_nonzero(~keep)) - (1 if starts[-1] == n else 0)  # after the last line end: not a line
    return Records(starts[keep], stops[keep], lines[keep], line_count, blank)


def _csv_find_records(raw: np.ndarray, dialect: Dialect) -> Records:
    found = list(_csv_records(raw.tobytes(), 0, len(raw), dialect))
    rows = [r for r in found if not r[3]]
    starts = np.array([r[0] for r in rows], dtype=np.int64)
    ends = np.array([r[2] - _terminator_bytes(raw, r[2]) for r in rows], dtype=np.int64)
    lines = np.array([r[1] for r in rows], dtype=np.int64)
    return Records(starts, ends, lines, count_lines(raw), len(found) - len(rows))


def _terminator_bytes(raw: np.ndarray, stop: int) -> int:
    if stop >= 2 and raw[stop - 2] == _CR and raw[stop - 1] == _LF:
        return 2
    return 1 if stop >= 1 and raw[stop - 1] in (_LF, _CR) else 0


def _csv_records(data, start: int, end: int, dialect: Dialect):
    """(start offset, first line index, end offset with its line end, blank) of each row of data[start:end],
    by Python's csv module fed one physical line at a time (so offsets are known)."""
    lines, at = [], start
    for line in bytes(data[start:end]).splitlines(keepends=True):
        lines.append((at, line))
        at += len(line)
    fed = [0]

    def feed():
        for k, (_, line) in enumerate(lines):
            fed[0] = k + 1
            yield line.decode("utf-8", "surrogateescape")

    begin = 0
    for row in csv.reader(feed(), **dialect.csv_options()):
        last_at, last = lines[fed[0] - 1]
        yield lines[begin][0], begin, last_at + len(last), row == []
        begin = fed[0]
