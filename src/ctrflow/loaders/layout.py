"""Where each feature lives in a loaded row, and how processed Parquet columns become arrays.

A row is 1 + num_dense + slots 32-bit words (the feature contract, `ctrflow.contract.features`): the label
(float32), one float32 word per dense feature, then the sparse ids (int32) with each sparse feature
taking `width` consecutive slots (1 for categorical, `max_length` for multi-hot), in feature order.
For Criteo that is 1 + 13 + 26 = 40 words, 160 bytes. The streaming loader's windows hold rows in
this layout, the in-memory loader's arrays hold its parts (labels, dense [N, num_dense], sparse
[N, slots]), and every batch is cut from it: `dense` [B, num_dense] float32, `sparse` [B, slots].

Every reader checks a part's columns against the features the same way (`check_columns`) and
turns a column into a numpy array the same way (`column_values`: [n], or [n, max_length] for a
multi-hot `fixed_size_list<int>` column), so their errors name the same file, column and cause.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from ctrflow.errors import UserError
from ctrflow.contract.features import LABEL, Features

INT32_LIMIT = 1 << 31  # ids are held as int32 words: anything outside [-2^31, 2^31) would be truncated


@dataclass(frozen=True)
class Column:
    """One Parquet column of a processed split: its kind, its words in a row, the sparse feature it is."""

    name: str
    kind: str  # label | dense | categorical | multi_hot
    first: int  # its first word in a row
    width: int  # its words in a row (multi-hot: max_length)
    feature: int = -1  # index into `Features.sparse` (-1: label or dense)

    @property
    def is_ids(self) -> bool:
        """A sparse feature's ids (int32 words), not a float32 value."""
        return self.feature >= 0


class RowLayout:
    """The word layout of rows with `features` (module doc): `columns` in Parquet order, `words` a row."""

    def __init__(self, features: Features):
        self.features = features
        columns = [Column(LABEL, "label", 0, 1)]
        columns += [Column(f.name, "dense", 1 + i, 1) for i, f in enumerate(features.dense)]
        self.first_id = 1 + features.num_dense  # words [first_id, words) are the sparse slots
        for k, (f, (start, stop)) in enumerate(zip(features.sparse, features.slot_spans())):
            columns.append(Column(f.name, f.kind, self.first_id + start, stop - start, k))
        self.columns = tuple(columns)
        self.words = self.first_id + features.slots
        self.row_bytes = 4 * self.words
        self.names = [c.name for c in self.columns]
        self.sparse_names = [f.name for f in features.sparse]
        # [slots]: the sparse feature of every slot (an error names the feature, not the slot)
        self.slot_features = np.asarray([k for k, f in enumerate(features.sparse) for _ in range(f.width)], np.int64)

    @property
    def num_dense(self) -> int:
        """Dense words of a row."""
        return self.features.num_dense

    @property
    def slots(self) -> int:
        """Sparse id slots of a row."""
        return self.features.slots

    def slot_limits(self, table_sizes: Sequence[int]) -> np.ndarray:
        """[slots] int64: each slot's table size (ids must lie in [0, size))."""
        sizes = np.asarray(table_sizes, dtype=np.int64)
        if len(sizes) != len(self.features.sparse):
            raise ValueError(f"{len(sizes)} table sizes for {len(self.features.sparse)} sparse features")
        return sizes[self.slot_features]


def read_features(data_dir: str | os.PathLike) -> Features:
    """The feature contract of a processed dataset: `data_dir/schema.json`'s features."""
    from ctrflow.contract.schema import Schema

    return Schema.load(Path(data_dir) / "schema.json").features


def check_columns(where: str | os.PathLike, schema: pa.Schema, layout: RowLayout,
                  columns: Sequence[Column] | None = None) -> None:
    """`UserError` naming the first of `columns` (default: all) that `schema` lacks or holds with a
    type the loaders cannot read (label and dense: numbers; categorical: integers; multi-hot:
    `fixed_size_list<integer>[max_length]`)."""
    columns = layout.columns if columns is None else columns
    missing = [c.name for c in columns if c.name not in schema.names]
    if missing:
        raise UserError(f"{where}: missing column(s) {', '.join(missing)}")
    for c in columns:
        kind = schema.field(c.name).type
        if c.kind == "multi_hot":
            ok = (pa.types.is_fixed_size_list(kind) and kind.list_size == c.width
                  and pa.types.is_integer(kind.value_type))
            expected = f"fixed_size_list<integer ids>[{c.width}]"
        elif c.is_ids:
            ok, expected = pa.types.is_integer(kind), "integer ids"
        else:
            ok, expected = pa.types.is_integer(kind) or pa.types.is_floating(kind), "numbers"
        if not ok:
            raise UserError(f"{where}: column {c.name} has type {kind}, expected {expected}")


def column_values(where: str, values: pa.ChunkedArray | pa.Array, column: Column) -> np.ndarray:
    """A column's values as numpy: [n], or [n, max_length] ids of a multi-hot column (zero-copy
    views where the types allow); a null value is a `UserError` naming `where` and the column."""
    single = values
    if isinstance(values, pa.ChunkedArray):
        single = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
    if column.kind == "multi_hot":
        flat = single.flatten()  # the rows' ids, in row order (respects a sliced array's offset)
        nulls = single.null_count + flat.null_count
        if nulls:
            raise UserError(f"{where}: column {column.name} has {nulls} null value(s)")
        return flat.to_numpy(zero_copy_only=False).reshape(len(single), column.width)
    if single.null_count:
        raise UserError(f"{where}: column {column.name} has {single.null_count} null value(s)")
    return single.to_numpy(zero_copy_only=False)  # no copy: fixed width, no nulls


def first_bad_ids(ids: np.ndarray, limit: int | None) -> int | None:
    """Index of the first row of `ids` ([n] or [n, width]) with an id outside [0, limit) (or, with
    `limit` None, outside the int32 range the loaders hold); None when every id is fine."""
    if not ids.size:
        return None
    if limit is None:
        if ids.dtype.itemsize < 4 or ids.dtype == np.int32:
            return None
        if ids.dtype.kind == "u":
            if ids.max() < INT32_LIMIT:
                return None
            bad = ids >= INT32_LIMIT
        else:
            if ids.min() >= -INT32_LIMIT and ids.max() < INT32_LIMIT:
                return None
            bad = (ids < -INT32_LIMIT) | (ids >= INT32_LIMIT)
    else:
        unsigned = ids.view(np.dtype(f"u{ids.dtype.itemsize}")) if ids.dtype.kind == "i" else ids
        if unsigned.max() < limit:  # negatives are huge as unsigned: one pass for both bounds
            return None
        bad = (ids < 0) | (ids >= limit)
    if bad.ndim == 2:
        bad = bad.any(axis=1)
    return int(np.argmax(bad))


def bad_id_message(where: str, row: int, name: str, values: np.ndarray, limit: int | None) -> str:
    """The one-line error for row number `row` (as the user counts it) of `where`, whose ids of
    feature `name` are `values` (a scalar or [width]; `first_bad_ids` found one of them bad)."""
    values = np.atleast_1d(values)
    if limit is None:
        value = next(int(v) for v in values if not -INT32_LIMIT <= int(v) < INT32_LIMIT)
        return (f"{where}: row {row}: {name} id {value} does not fit in 32 bits (was the data written by "
                f"`ctrflow preprocess`?)")
    value = next(int(v) for v in values if not 0 <= int(v) < limit)
    return (f"{where}: row {row}: {name} id {value} is outside its embedding table of {limit} rows "
            f"(ids must be in [0, {limit}); does the data match schema.json?)")
