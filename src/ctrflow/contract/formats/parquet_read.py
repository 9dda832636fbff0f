"""Parquet input of a table dataset: pieces of row groups, read and checked like text rows.

A piece is a run of whole row groups of about `chunk_rows` rows, read by a worker on its own. Rows
are numbered from 1 in their file (an error names "row N"). Types: the label numeric or boolean, 0/1;
dense columns numeric, boolean or text holding numbers; categorical columns any type, read as their
text (an integer 7 is "7"); multi-hot columns a list of values, or text split at the separator.
Nulls: a missing dense or categorical value, an empty list; a null label is a bad row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ctrflow.contract.description import Description
from ctrflow.errors import UserError
from ctrflow.contract.numbers import not_finite, parse_numbers


@dataclass(frozen=True)
class ParquetPiece:
    """A task: whole row groups of one Parquet file."""

    file_index: int
    index: int  # order within its file
    path: str
    row_groups: tuple[int, ...]
    first_row: int  # the file's row number (from 0) of the piece's first row


def open_parquet(path: Path) -> pq.ParquetFile:
    """The file, or a one-line UserError naming it."""
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None


def check_parquet(path: Path, description: Description) -> None:
    """Every described column is in the file's schema, with a type its role can read."""
    schema = open_parquet(path).schema_arrow
    check_parquet_rows(path)
    description.check_columns(schema.names, f"{path}'s Parquet schema")
    for name in description.used_columns:
        kind = schema.field(name).type
        role = description.role(name)
        numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) \
            or pa.types.is_decimal(kind)
        text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_dictionary(kind)
        if role in ("label", "dense") and not (numeric or text):
            raise UserError(f"{description.source}: column {name!r} ({role}) of {path} has type {kind}, not numbers")
        if role == "multi_hot" and not (text or pa.types.is_list(kind) or pa.types.is_large_list(kind)
                                        or pa.types.is_fixed_size_list(kind)):
            raise UserError(f"{description.source}: column {name!r} (multi_hot) of {path} has type {kind}, "
                            "not a list or separated text")


def check_parquet_rows(path: Path) -> None:
    """A one-line UserError when a Parquet file holds no row."""
    if open_parquet(path).metadata.num_rows == 0:
        raise UserError(f"{path}: the Parquet file holds no row: nothing to read")


def plan_pieces(path: Path, file_index: int, chunk_rows: int) -> list[ParquetPiece]:
    """The file's row groups, gathered into pieces of at least `chunk_rows` rows (or one group each)."""
    metadata = open_parquet(path).metadata
    pieces, groups, rows, first = [], [], 0, 0
    for g in range(metadata.num_row_groups):
        groups.append(g)
        rows += metadata.row_group(g).num_rows
        if rows >= chunk_rows:
            pieces.append(ParquetPiece(file_index, len(pieces), str(path), tuple(groups), first))
            first, groups, rows = first + rows, [], 0
    if groups:
        pieces.append(ParquetPiece(file_index, len(pieces), str(path), tuple(groups), first))
    return pieces


def read_piece(piece: ParquetPiece, description: Description, with_label: bool = True
               ) -> tuple[pa.Table, np.ndarray, list]:
    """(good rows: label float64, dense float64/int64, sparse columns as read; their row numbers in the
    piece (int64); problems (row in the piece, reason, raw row as JSON)). `with_label`: the file has the
    label column (predict reads files without it)."""
    used = [c for c in description.used_columns if with_label or c != description.label]
    table = open_parquet(Path(piece.path)).read_row_groups(list(piece.row_groups), columns=used)
    n = len(table)
    reasons: dict[int, str] = {}
    columns = {}
    for name in used:
        column = table.column(name).combine_chunks()
        role = description.role(name)
        if role in ("label", "dense"):
            column, bad = _numbers(column, name, description.dense_type == "integer" and role == "dense")
            for i, reason in bad:
                reasons.setdefault(i, reason)
            if role == "label":
                values = pc.fill_null(column, -1.0).to_numpy(zero_copy_only=False)
                for i in np.flatnonzero((values != 0) & (values != 1)):
                    reasons.setdefault(int(i), f"column {name}: the label is missing" if column[int(i)].as_py()
                                       is None else f"column {name}: the label must be 0 or 1, got {values[i]:g}")
        columns[name] = column
    if not reasons:
        return pa.table(columns), np.arange(n, dtype=np.int64), []
    bad = sorted(reasons)
    keep = np.ones(n, dtype=bool)
    keep[bad] = False
    problems = [(i, reasons[i], json.dumps(_row(table, i), default=str).encode()) for i in bad]
    return pa.table(columns).filter(pa.array(keep)), np.flatnonzero(keep).astype(np.int64), problems


def _numbers(column: pa.Array, name: str, integer: bool) -> tuple[pa.Array, list[tuple[int, str]]]:
    """float64 (int64 for integer dense columns) with nulls where missing, and the bad values."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        values, bad = parse_numbers(pc.fill_null(column, ""), integer)
        what = "an integer" if integer else "a number"
        problems = [(i, f"column {name}: not {what}: {column[i].as_py()!r}") for i in bad]
    else:
        values, problems = column.cast(pa.float64()), []
        if integer and len(values):
            fraction = pc.fill_null(pc.not_equal(values, pc.floor(values)), False).to_numpy(zero_copy_only=False)
            problems = [(int(i), f"column {name}: not an integer: {values[int(i)].as_py()!r}")
                        for i in np.flatnonzero(fraction)]
    problems += [(int(i), f"column {name}: not a finite number: {values[int(i)].as_py()!r}")
                 for i in not_finite(values)]
    return values, problems


def _row(table: pa.Table, i: int) -> dict:
    return {name: table.column(name)[i].as_py() for name in table.column_names}
