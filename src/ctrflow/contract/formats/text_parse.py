"""Parse a block of whole CSV/TSV rows into typed columns, naming every bad row by its line.

Fast path: pyarrow's CSV reader on the block, single-threaded (a worker per core runs blocks side by
side), only the described columns converted: the label and dense columns as numbers, categorical and
multi-hot columns dictionary-encoded by the reader as binary (each block's distinct values once; their
UTF-8 is checked on the dictionary, not per row: 0.20 against 0.23 CPU-s per 625,000 rows of a
MovieLens-like table for reading them as binary and encoding them after the parse, pyarrow 25).
Rows with the wrong number of fields are set aside by the
reader itself. Only a block where a value fails (a non-number, a label other than 0/1, bytes that are
not UTF-8) is parsed again as text, row by row checks naming the line, column and problem; its good
rows are then parsed the fast way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from ctrflow.contract.description import Description
from ctrflow.contract.formats.text_rows import Dialect, Records, count_lines, find_records
from ctrflow.errors import UserError
from ctrflow.contract.numbers import all_finite, not_finite, parse_numbers

@dataclass
class ParsedRows:
    """A block's good rows as typed columns, and the others as problems (line index, reason, raw row)."""

    lines: int  # physical lines in the block
    rows_read: int  # rows in the block (a header and blank lines are no rows)
    blank_lines: int
    table: pa.Table | None  # label float64, dense float64/int64, categorical/multi-hot dictionary<binary→string>
    offsets: np.ndarray | None  # int64 [rows]: where each good row starts in the block (when asked for)
    problems: list[tuple[int, str, bytes]] = field(default_factory=list)


def dialect_of(description: Description) -> Dialect:
    """The description's delimiter and quote as bytes."""
    quote = description.quote.encode() if description.quote else None
    return Dialect(description.delimiter.encode(), quote)


class _Invalid:
    """pyarrow's invalid-row handler: remembers rows with the wrong number of fields and skips them."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []  # (row number from 1, expected, found)

    def __call__(self, row) -> str:
        self.rows.append((row.number, row.expected_columns, row.actual_columns))
        return "skip"


def _read(data, columns: list[str], used: list[str], types: dict, dialect: Dialect, handler: _Invalid,
          quoted: bool, ignore_empty_lines: bool = True) -> pa.Table:
    """pyarrow's reader on whole rows; `quoted`: the file holds quotes (so a value may hold a newline)."""
    return pcsv.read_csv(
        pa.BufferReader(data),
        read_options=pcsv.ReadOptions(column_names=columns, use_threads=False, block_size=max(1 << 16, len(data) + 1)),
        parse_options=pcsv.ParseOptions(delimiter=dialect.delimiter.decode(),
                                        quote_char=dialect.quote.decode() if dialect.quote else False,
                                        newlines_in_values=quoted, ignore_empty_lines=ignore_empty_lines,
                                        invalid_row_handler=handler),
        convert_options=pcsv.ConvertOptions(include_columns=used, column_types=types, null_values=[""],
                                            strings_can_be_null=False))


def _types(description: Description, text: bool, with_label: bool = True) -> dict:
    number = pa.int64() if description.dense_type == "integer" else pa.float64()
    types = {description.label: pa.binary() if text else pa.float64()} if with_label else {}
    types.update({c: pa.binary() if text else number for c in description.dense})
    sparse = pa.binary() if text else pa.dictionary(pa.int32(), pa.binary())
    types.update({c: sparse for c in description.sparse})
    return types


def parse_text_block(data, description: Description, columns: list[str], header_end: int = 0,
                     quoted: bool = True, clean: bool = True, offsets: bool = False, text: bool = False,
                     with_label: bool = True, returns: bool = True) -> ParsedRows:
    """Parse `data` (whole rows; the first `header_end` bytes are the header, skipped). `columns`: every
    column of the file in order; `quoted`: the file holds quote characters; `clean`: they are all where
    RFC 4180 puts them (see `text_rows`); `offsets`: also give each good row's offset in the block (the
    split's coin needs it). `text`: keep the good rows' values as text (strings; every value checked as
    the typed parse checks it), as predict hands them to `transform_raw`; `with_label`: the file has the
    label column; `returns`: the block may hold a carriage return."""
    dialect = dialect_of(description)
    if not (quoted or returns or offsets or text):
        parsed = _parse_plain(data, description, columns, header_end, dialect)
        if parsed is not None:
            return parsed
    # lines counted by \n alone (one pass); where that may be wrong (a lone \r, a quoted newline, a blank
    # line) rows and lines disagree below, and `find_records` counts them exactly
    lines = count_lines(data, returns=False)
    body = memoryview(data)[header_end:] if header_end else data
    header_lines = count_lines(memoryview(data)[:header_end]) if header_end else 0
    if text:
        records = find_records(body, dialect, clean)
        lines = header_lines + records.line_count
        return _parse_slowly(body, description, columns, records, lines, header_lines, header_end, quoted, offsets,
                             text=True, with_label=with_label)
    used = list(description.used_columns)
    invalid = _Invalid()
    try:
        table = _read(body, columns, used, _types(description, text=False), dialect, invalid, quoted)
        table = _checked(table, description)
    except (pa.ArrowInvalid, UnicodeDecodeError):
        table = None
    records = None
    if table is None or invalid.rows or offsets or (lines - header_lines != len(table) + len(invalid.rows)):
        records = find_records(body, dialect, clean)  # blank lines, quoted newlines or lone \r: exact lines
        lines = header_lines + records.line_count
    if table is None:
        return _parse_slowly(body, description, columns, records, lines, header_lines, header_end, quoted, offsets)
    rows_read = len(table) + len(invalid.rows)
    _check_rows(records, rows_read, body, header_lines)
    problems = [_field_count(records, number, expected, found, body, header_lines)
                for number, expected, found in invalid.rows]
    good = _good_rows(records, invalid.rows) if records is not None else None
    blank = records.blank_lines if records is not None else 0
    return ParsedRows(lines, rows_read, blank, table,
                      records.starts[good] + header_end if offsets else None, problems)


def _parse_plain(data, description: Description, columns: list[str], header_end: int,
                 dialect: Dialect) -> ParsedRows | None:
    """A block with neither quotes nor carriage returns, each line a row: read with its empty lines kept
    (as rows of nulls, which fail the checks), the reader's row count is its line count, and no pass
    counts lines. None when a row is not clean (the block is then read as any other)."""
    invalid = _Invalid()
    body = memoryview(data)[header_end:] if header_end else data
    try:
        table = _read(body, columns, list(description.used_columns), _types(description, text=False), dialect,
                      invalid, quoted=False, ignore_empty_lines=False)
        table = _checked(table, description)
    except (pa.ArrowInvalid, UnicodeDecodeError):
        return None
    if table is None or invalid.rows:
        return None
    header_lines = count_lines(memoryview(data)[:header_end]) if header_end else 0
    return ParsedRows(header_lines + len(table), len(table), 0, table, None)


def _checked(table: pa.Table, description: Description) -> pa.Table | None:
    """The table with its dictionaries as UTF-8 strings, or None when a value is bad (the slow path then
    names it): a label other than 0/1, a dense value not finite, a dictionary entry not UTF-8."""
    if not len(table):
        return table
    label = table.column(description.label)
    if label.null_count:
        return None
    values = label.combine_chunks().to_numpy()  # float64, no nulls: no copy
    if np.count_nonzero(values == 1.0) != np.count_nonzero(values):  # a non-zero label other than 1 (or nan)
        return None
    if not all(all_finite(table.column(c).combine_chunks()) for c in description.dense):
        return None
    for name in description.sparse:
        column = table.column(name)
        try:
            if column.num_chunks == 1 and pa.types.is_dictionary(column.type):
                column = column.chunk(0)  # the reader's own dictionary (one chunk: one block, one thread)
            else:
                column = pc.dictionary_encode(pc.cast(column, pa.binary()).combine_chunks())
            strings = pa.DictionaryArray.from_arrays(column.indices, column.dictionary.cast(pa.string()))
        except pa.ArrowInvalid:  # not UTF-8
            return None
        table = table.set_column(table.schema.get_field_index(name), name, strings)
    return table


def _check_rows(records: Records | None, rows_read: int, body, header_lines: int) -> None:
    if records is not None and len(records.starts) != rows_read:  # never seen: the row split disagrees
        raise UserError(f"line {header_lines + 1}: cannot tell this block's rows apart ({len(records.starts)} "
                        f"found, the CSV reader read {rows_read}); are the quotes balanced?")


def _field_count(records: Records, number: int, expected: int, found: int, body, header_lines: int):
    k = number - 1
    raw = bytes(body[records.starts[k]:records.ends[k]])
    return int(records.lines[k]) + header_lines, f"expected {expected} fields, found {found}", raw


def _good_rows(records: Records, invalid) -> np.ndarray:
    good = np.ones(len(records.starts), dtype=bool)
    good[[number - 1 for number, _, _ in invalid]] = False
    return np.flatnonzero(good)


def _parse_slowly(body, description: Description, columns: list[str], records: Records, lines: int,
                  header_lines: int, header_end: int, quoted: bool, offsets: bool, text: bool = False,
                  with_label: bool = True) -> ParsedRows:
    """Every used column as text, checked row by row; the good rows then parsed the fast way (`text`: kept
    as text)."""
    invalid = _Invalid()
    used = [c for c in description.used_columns if with_label or c != description.label]
    strings = _read(body, columns, used, _types(description, True, with_label), dialect_of(description), invalid,
                    quoted)
    rows_read = len(strings) + len(invalid.rows)
    _check_rows(records, rows_read, body, header_lines)
    problems = {number - 1: _field_count(records, number, e, f, body, header_lines)[1:]
                for number, e, f in invalid.rows}
    in_table = _good_rows(records, invalid.rows)  # record index of each table row
    bad_rows = set()
    for row, reason in _bad_values(strings, description, used):
        problems.setdefault(int(in_table[row]), (reason, None))
        bad_rows.add(row)
    ordered = []
    for k in sorted(problems):
        raw = bytes(body[records.starts[k]:records.ends[k]])
        ordered.append((int(records.lines[k]) + header_lines, problems[k][0], raw))
    good = np.array([k for k in range(len(records.starts)) if k not in problems], dtype=np.int64)
    table = None
    if text:
        keep = np.ones(len(strings), dtype=bool)
        keep[sorted(bad_rows)] = False
        kept = strings.filter(pa.array(keep))  # bytes that are not UTF-8 are in bad rows only
        table = pa.table({c: kept.column(c).cast(pa.string()) for c in used})
    elif len(good):
        joined = b"\n".join(bytes(body[records.starts[k]:records.ends[k]]) for k in good) + b"\n"
        table = _checked(_read(joined, columns, list(description.used_columns), _types(description, text=False),
                               dialect_of(description), _Invalid(), quoted), description)
        if table is None or len(table) != len(good):
            raise UserError(f"line {header_lines + 1}: rows that passed every check failed to parse again")
    return ParsedRows(lines, rows_read, records.blank_lines, table,
                      records.starts[good] + header_end if offsets else None, ordered)


def _bad_values(text: pa.Table, description: Description, used):
    """(table row, "column X: problem") of every bad value, columns in description order."""
    for name in used:
        column = text.column(name).combine_chunks()
        try:
            strings = column.cast(pa.string())
        except pa.ArrowInvalid:
            bad = [i for i, v in enumerate(column.to_pylist()) if not _utf8(v)]
            for i in bad:
                yield i, f"column {name}: not valid UTF-8"
            keep = np.ones(len(column), dtype=bool)
            keep[bad] = False
            strings = pc.if_else(pa.array(keep), column, pa.scalar(b"", pa.binary())).cast(pa.string())
        role = description.role(name)
        if role == "label":
            values, bad = parse_numbers(strings)
            for i in bad:
                yield i, f"column {name}: the label must be 0 or 1, got {strings[i].as_py()!r}"
            for i in np.flatnonzero(~np.isin(pc.fill_null(values, -1.0).to_numpy(zero_copy_only=False), [0.0, 1.0])):
                if i not in bad:
                    got = strings[int(i)].as_py()
                    yield int(i), (f"column {name}: the label is missing" if got.strip() == ""
                                   else f"column {name}: the label must be 0 or 1, got {got!r}")
        elif role == "dense":
            integer = description.dense_type == "integer"
            values, bad = parse_numbers(strings, integer)
            what = "an integer" if integer else "a number"
            for i in bad:
                yield i, f"column {name}: not {what}: {strings[i].as_py()!r}"
            for i in not_finite(values):
                yield int(i), f"column {name}: not a finite number: {strings[int(i)].as_py()!r}"


def _utf8(value: bytes | None) -> bool:
    try:
        (value or b"").decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
