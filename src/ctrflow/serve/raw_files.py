"""Raw files in a dataset description's format, read as the text columns the served ensemble takes.

A client of the Triton ensemble sends, per raw column a model reads, the text its files hold (a
number, a category, a multi-hot list joined by the column's separator; "" = missing).
`ctrflow predict` reads files here into exactly those columns, then runs the serving transform on
them, so offline and online scores cannot differ.

The layout comes from `schema.json`'s `dataset` (the description preprocess was given): `format`
csv | tsv | parquet, `header`, `delimiter`, `quote` (csv '"', tsv none by default), `columns`
(headerless files), `label`, and each multi-hot column's `separator`. A schema without a format
(one written before descriptions existed) means the raw Criteo layout: tab-separated, no header,
the label then the features in order. Headerless files may leave the label out (Kaggle's test
layout); files with a header may too. Plain or gzip.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.errors import UserError
from ctrflow.serve import raw_inputs

BLOCK_BYTES = 16 << 20  # text read per block: rows scored at once stay bounded
DEFAULT_SEPARATOR = "|"


@dataclass(frozen=True)
class RawFormat:
    """How a dataset's raw files are laid out (module doc)."""

    format: str  # csv | tsv | parquet
    inputs: tuple[str, ...]  # the raw columns a model reads, in the ensemble's input order
    label: str  # the raw label column
    header: bool = False
    delimiter: str = "\t"
    quote: str | None = None  # csv/tsv quote character; None: fields are never quoted
    columns: tuple[str, ...] = ()  # a headerless file's columns, in order
    separators: dict[str, str] = field(default_factory=dict)  # multi-hot column -> separator


@dataclass(frozen=True)
class RawBlock:
    """Consecutive rows of one file: text per input column, labels (NaN: none), where they start."""

    columns: dict[str, pa.Array]  # input column -> string array, "" = missing
    labels: np.ndarray | None  # float32 [n], None when the file has no label column
    first_line: int  # the file line of the block's first row (1-based; rows are one line each)
    rows: int


def raw_format(schema) -> RawFormat:
    """The raw layout of `schema`'s dataset (module doc)."""
    features = schema.features
    described: Mapping[str, Any] = schema.dataset or {}
    inputs = raw_inputs(features)
    multi_hot = described.get("multi_hot") or {}
    separators = {f.name: str((multi_hot.get(f.name) or {}).get("separator", DEFAULT_SEPARATOR))
                  for f in features.sparse if f.kind == "multi_hot"}
    label = str(described.get("label", "label"))
    if "format" not in described:  # the built-in raw layout
        return RawFormat("tsv", inputs, label, columns=(label, *inputs), separators=separators)
    kind = str(described["format"])
    if kind not in ("csv", "tsv", "parquet"):
        raise UserError(f"schema.json dataset: format {kind!r} is not csv, tsv or parquet")
    delimiter = str(described.get("delimiter", "," if kind == "csv" else "\t"))
    quote = described.get("quote", '"' if kind == "csv" else None)
    header = bool(described.get("header", True))
    columns = tuple(described.get("columns") or ()) or (() if header else (label, *inputs))
    return RawFormat(kind, inputs, label, header, delimiter, quote or None, columns, separators)


def read_raw_file(path: str | os.PathLike, fmt: RawFormat, block_bytes: int = BLOCK_BYTES) -> Iterator[RawBlock]:
    """The rows of one raw file, block by block; a malformed file raises `UserError` naming it, the
    line and the column."""
    path = Path(path)
    if fmt.format == "parquet":
        yield from _read_parquet(path, fmt)
    else:
        yield from _read_text(path, fmt, block_bytes)


def _open_binary(path: Path):
    try:
        raw = open(path, "rb")
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    magic = raw.read(2)
    raw.seek(0)
    return gzip.GzipFile(fileobj=raw, mode="rb") if magic == b"\x1f\x8b" else raw


def _text_columns(path: Path, fmt: RawFormat) -> tuple[list[str], bool]:
    """(the file's columns in order, whether it holds the label), from its header or first line."""
    with _open_binary(path) as f:
        try:
            first = f.readline().decode("utf-8").rstrip("\r\n")
        except (OSError, EOFError) as err:
            raise UserError(f"{path}: line 1: cannot read ({err})") from None
        except UnicodeDecodeError:
            raise UserError(f"{path}: line 1: not UTF-8 text") from None
    quoting = {"quotechar": fmt.quote} if fmt.quote else {"quoting": csv.QUOTE_NONE}
    names = next(csv.reader([first], delimiter=fmt.delimiter, **quoting), []) if first else []
    if fmt.header:
        missing = [c for c in fmt.inputs if c not in names]
        if first and missing:
            raise UserError(f"{path}: line 1: the header has no column {missing[0]!r} "
                            f"({len(missing)} input column(s) missing)")
        return names, fmt.label in names
    if not first or len(names) == len(fmt.columns):
        return list(fmt.columns), fmt.label in fmt.columns
    if fmt.label in fmt.columns and len(names) == len(fmt.columns) - 1:
        return [c for c in fmt.columns if c != fmt.label], False
    raise UserError(f"{path}: line 1: expected {len(fmt.columns)} fields (with the label) or "
                    f"{len(fmt.columns) - 1} (without), separated by {fmt.delimiter!r}, found {len(names)}")


def _read_text(path: Path, fmt: RawFormat, block_bytes: int) -> Iterator[RawBlock]:
    import pyarrow.csv as pa_csv

    names, labelled = _text_columns(path, fmt)
    wanted = [*fmt.inputs, *([fmt.label] if labelled else [])]
    read = pa_csv.ReadOptions(column_names=None if fmt.header else names, block_size=block_bytes)
    quoted = fmt.quote is not None
    parse = pa_csv.ParseOptions(delimiter=fmt.delimiter, quote_char=fmt.quote if quoted else False,
                                newlines_in_values=quoted)
    convert = pa_csv.ConvertOptions(column_types={c: pa.string() for c in wanted}, include_columns=wanted,
                                    strings_can_be_null=False, quoted_strings_can_be_null=False)
    line = 2 if fmt.header else 1
    stream = _open_binary(path)
    try:
        try:
            reader = pa_csv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert)
            for batch in reader:
                if batch.num_rows:
                    yield _block(path, batch, fmt, labelled, line)
                line += batch.num_rows
        except (pa.ArrowInvalid, UnicodeDecodeError) as err:
            raise UserError(locate_problem(path, fmt, len(names), str(err))) from None
    finally:
        stream.close()


def locate_problem(path: Path, fmt: RawFormat, fields: int, reason: str) -> str:
    """`file: line N: what is wrong` for a text file pyarrow refused (it names no line): the first
    line with another number of fields or bytes that are not UTF-8, found by a slower re-read."""
    with _open_binary(path) as f:
        text = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
        quoting = {"quotechar": fmt.quote} if fmt.quote else {"quoting": csv.QUOTE_NONE}
        rows = csv.reader(text, delimiter=fmt.delimiter, **quoting)
        start = 0
        for row in rows:
            if start == 0 and fmt.header:
                start = rows.line_num
                continue
            bad_text = next((i for i, value in enumerate(row) if any("\udc80" <= ch <= "\udcff" for ch in value)),
                            None)
            if bad_text is not None:
                return f"{path}: line {rows.line_num}: field {bad_text + 1}: not UTF-8 text"
            if row and len(row) != fields:
                return f"{path}: line {rows.line_num}: expected {fields} fields, found {len(row)}"
    return f"{path}: {reason.splitlines()[0]}"


def _block(path: Path, batch: pa.RecordBatch, fmt: RawFormat, labelled: bool, line: int) -> RawBlock:
    columns = {c: batch.column(c) for c in fmt.inputs}
    labels = parse_labels(path, batch.column(fmt.label), line) if labelled else None
    return RawBlock(columns, labels, line, batch.num_rows)


def parse_labels(path: Path, text: pa.Array, first_line: int) -> np.ndarray:
    """Label text "0" / "1" -> float32 0 / 1, "" -> NaN (unknown); anything else is a `UserError`."""
    values = pc.utf8_trim_whitespace(text.cast(pa.string()).fill_null(""))
    ones, zeros, empty = (pc.equal(values, v).to_numpy(zero_copy_only=False) for v in ("1", "0", ""))
    bad = ~(ones | zeros | empty)
    if bad.any():
        row = int(np.argmax(bad))
        raise UserError(f"{path}: line {first_line + row}: label {values[row].as_py()!r} is not 0 or 1")
    return np.where(empty, np.nan, ones.astype(np.float32)).astype(np.float32)


def _read_parquet(path: Path, fmt: RawFormat) -> Iterator[RawBlock]:
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: cannot read Parquet ({err})") from None
    names = reader.schema_arrow.names
    missing = [c for c in fmt.inputs if c not in names]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} ({len(missing)} input column(s) missing)")
    labelled = fmt.label in names
    row = 0
    for batch in reader.iter_batches(columns=[*fmt.inputs, *([fmt.label] if labelled else [])]):
        columns = {c: as_text(batch.column(c), fmt.separators.get(c, DEFAULT_SEPARATOR)) for c in fmt.inputs}
        labels = stored_labels(path, batch.column(fmt.label), row + 1) if labelled else None
        yield RawBlock(columns, labels, row + 1, batch.num_rows)
        row += batch.num_rows


def stored_labels(path: Path, values: pa.Array, first_row: int) -> np.ndarray:
    """A Parquet label column (text, integers, floats or booleans) -> float32 0 / 1, NaN where null."""
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return parse_labels(path, values, first_row)
    numbers = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
    bad = ~(np.isnan(numbers) | (numbers == 0) | (numbers == 1))
    if bad.any():
        row = int(np.argmax(bad))
        raise UserError(f"{path}: row {first_row + row}: label {numbers[row]!r} is not 0 or 1")
    return numbers.astype(np.float32)


def as_text(values: pa.Array, separator: str) -> pa.Array:
    """A Parquet column as the text a raw file would hold: numbers as written, a list column's
    items joined by `separator`, null -> ""."""
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or pa.types.is_fixed_size_list(
            values.type):
        items = values.cast(pa.list_(pa.string()))
        return pc.binary_join(items, separator).fill_null("")
    return values.cast(pa.string()).fill_null("")
