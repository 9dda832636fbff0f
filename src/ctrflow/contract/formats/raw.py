"""Raw rows of a file in a description's format, as text, for `ctrflow predict --input FILE`.

`read_raw_rows(path, description)` yields blocks of rows: the raw text of each raw column (what
`ctrflow.contract.transform.transform_raw` takes) and the labels, or None where the file has no
label column (a header without it; a header-less file with one field fewer than `columns`, such as
Kaggle's unlabelled Criteo test layout). Every value is checked as preprocessing checks it: a bad row
raises a one-line `UserError` naming the file, the line (Parquet: the row) and the column.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.description import Description
from ctrflow.contract.formats.parquet_read import check_parquet_rows, open_parquet, plan_pieces, read_piece
from ctrflow.contract.formats.text_parse import dialect_of, parse_text_block
from ctrflow.contract.formats.sources import open_mapped
from ctrflow.contract.formats.text_rows import BOM, check_has_rows, iter_blocks, read_header, row_end_after, scan_quotes
from ctrflow.errors import UserError
from ctrflow.contract.formats.files import is_gzip
from ctrflow.contract.numbers import parse_numbers

BLOCK_BYTES = 16 << 20
BLOCK_ROWS = 1 << 16


@dataclass
class RawRows:
    """One block of a raw file: `columns` maps each raw column to its values as text (string arrays)."""

    columns: dict[str, pa.Array]
    labels: np.ndarray | None  # float32 [n] (0/1), or None: the file has no label column
    kept: dict[str, pa.Array] = field(default_factory=dict)  # the `keep` columns' values as text


def read_raw_rows(path: str | os.PathLike, description: Description, block_bytes: int = BLOCK_BYTES,
                  keep: Sequence[str] = ()) -> Iterator[RawRows]:
    """The rows of a CSV/TSV (plain or gzip) or Parquet file, block by block, in file order; `keep`: other
    columns of the file to pass through as text (`RawRows.kept`; one the file lacks is a UserError)."""
    path = Path(path)
    extra = tuple(c for c in keep if c not in description.used_columns)
    description = replace(description, categorical=(*description.categorical, *extra))  # read as text
    if description.format == "parquet":
        yield from _parquet_rows(path, description, keep)
        return
    if not is_gzip(path):
        yield from _text_rows(path, path, description, block_bytes, keep)
        return
    with tempfile.TemporaryDirectory(prefix="ctrflow-raw-") as work:
        plain = Path(work) / "input.txt"
        try:
            with gzip.open(path, "rb") as source, open(plain, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 22)
        except (OSError, EOFError) as err:
            raise UserError(f"{path}: corrupt or truncated gzip file ({err})") from None
        yield from _text_rows(path, plain, description, block_bytes, keep)


def _text_rows(path: Path, source: Path, description: Description, block_bytes: int, keep: Sequence[str]
               ) -> Iterator[RawRows]:
    mapped = open_mapped(source)
    dialect = dialect_of(description)
    skip = len(BOM) if mapped[:len(BOM)] == BOM else 0
    head = bytes(mapped[:1 << 20])
    scan = scan_quotes(head, dialect, skip)  # the header's and first row's quotes
    if description.header:
        columns, header_end = read_header(head, dialect, scan)
        check_has_rows(path, head, header_end, len(head) == len(mapped))
        _check_kept(path, keep, columns)
        with_label = description.label in columns
        missing = [c for c in description.raw_columns if c not in columns]
        if missing:
            hint = description.delimiter_hint(columns)
            raise UserError(f"{path}: line 1: the header has no column {missing[0]!r} "
                            f"({description.role(missing[0])} in {description.source})" + (f": {hint}" if hint else ""))
    else:
        header_end = skip
        check_has_rows(path, head, header_end, len(head) == len(mapped))
        columns, with_label = _layout(path, head, description, skip, scan)
        _check_kept(path, keep, columns)
    base = 0
    for k, (begin, end, quoted, clean) in enumerate(iter_blocks(mapped, header_end, block_bytes, dialect)):
        start, header = (0, header_end) if k == 0 else (begin, 0)
        parsed = parse_text_block(memoryview(mapped)[start:end], description, columns, header, quoted, clean,
                                  text=True, with_label=with_label)
        if parsed.problems:
            line, reason, _ = parsed.problems[0]
            raise UserError(f"{path}: line {base + line + 1}: {reason}")
        base += parsed.lines
        if parsed.table is not None and len(parsed.table):
            yield _raw(parsed.table, description, with_label, keep)


def _layout(path: Path, head: bytes, description: Description, skip: int, scan) -> tuple[list[str], bool]:
    """A header-less file's columns (`head`: its first bytes): all of `columns`, or all but the label (one
    field fewer)."""
    first = head[skip:row_end_after(head, skip, dialect_of(description), scan)]
    rows = csv.reader(io.StringIO(first.decode("utf-8", "replace")), **dialect_of(description).csv_options())
    fields = len(next(rows, []))
    full = list(description.columns)
    if fields == len(full):
        return full, True
    if fields == len(full) - 1:
        return [c for c in full if c != description.label], False
    raise UserError(f"{path}: line 1: expected {len(full)} fields (with the label) or {len(full) - 1} "
                    f"(without), found {fields}")


def _check_kept(path: Path, keep: Sequence[str], columns: Sequence[str]) -> None:
    unknown = [c for c in keep if c not in columns]
    if unknown:
        shown = ", ".join(list(columns)[:12]) + (", ..." if len(columns) > 12 else "")
        raise UserError(f"{path}: --keep-columns: no column {unknown[0]!r} in the file (its columns: {shown})")


def _raw(table: pa.Table, description: Description, with_label: bool, keep: Sequence[str]) -> RawRows:
    columns = {c: table.column(c).combine_chunks() for c in description.raw_columns}
    labels = None
    if with_label:
        values, _ = parse_numbers(table.column(description.label).combine_chunks())
        labels = pc.fill_null(values, 0).to_numpy(zero_copy_only=False).astype(np.float32)
    return RawRows(columns, labels, {c: _text(columns[c]) for c in keep})


def _text(column: pa.Array) -> pa.Array:
    """A column's values as plain strings ("" where missing)."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    return pc.fill_null(column.cast(pa.string()), "")


def _parquet_rows(path: Path, description: Description, keep: Sequence[str]) -> Iterator[RawRows]:
    names = open_parquet(path).schema_arrow.names
    check_parquet_rows(path)
    _check_kept(path, keep, names)
    missing = [c for c in description.raw_columns if c not in names]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} ({description.role(missing[0])} in {description.source})")
    with_label = description.label in names
    for piece in plan_pieces(path, 0, BLOCK_ROWS):
        table, _, problems = read_piece(piece, description, with_label)
        if problems:
            row, reason, _ = problems[0]
            raise UserError(f"{path}: row {piece.first_row + row + 1}: {reason}")
        columns = {}
        for name in description.raw_columns:
            column = table.column(name).combine_chunks()
            if pa.types.is_dictionary(column.type):
                column = column.cast(column.type.value_type)
            if name in description.multi_hot and not (pa.types.is_string(column.type)
                                                      or pa.types.is_large_string(column.type)):
                flat = pc.fill_null(column.cast(pa.list_(pa.string())), [])
                column = pc.binary_join(flat, description.multi_hot[name].separator)
            columns[name] = pc.fill_null(column.cast(pa.string()), "")
        labels = None
        if with_label:
            labels = table.column(description.label).to_numpy(zero_copy_only=False).astype(np.float32)
        yield RawRows(columns, labels, {c: columns[c] for c in keep})
