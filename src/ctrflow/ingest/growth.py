"""Growing vocabularies: a new day processed against an earlier output's vocabularies (`--vocab-from DIR`).

Every value of the earlier vocabulary keeps its id; the new day's values that reach the threshold and
were not in it get the next ids, after the old ones, most frequent first (ties by value bytes), by
their count in the new day's training split. So a model trained on the earlier data reads the new
data with its tables grown at the end (`ctrflow train --init-from`).

Counts: a grown vocabulary's `count` is the running count of each kept value: the earlier count plus
the new day's (days summed); a value admitted today starts at today's count. A value below the
threshold on a day is not kept, so its count of that day is lost: admission is decided on one day's
count, never on a sum over days. The merge keeps, besides the values reaching the threshold, the
new day's counts of the earlier values (looked up by hash range, as the runs are merged), so memory
stays bounded by the vocabularies and preprocessing stays two passes. The vocabulary is then no
longer sorted by count: the old ids come first, whatever their counts now.

A vocabulary never shrinks: values that stop appearing keep their ids (and rows in a model). To start
afresh, preprocess without `--vocab-from` (and train a new model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ctrflow.errors import UserError
from ctrflow.contract.features import Features
from ctrflow.contract.schema import Schema, feature_differences


@dataclass(frozen=True)
class PreviousVocabulary:
    """The processed data a new day's vocabularies extend: its directory and schema."""

    path: Path  # resolved
    schema: Schema

    def table(self, name: str) -> pa.Table:
        """Feature `name`'s vocabulary (value, count; row k has id k + 2)."""
        return read_vocab_table(self.path, name)

    def parent(self) -> dict:
        """What the new schema.json records under `parent`: the lineage to follow back."""
        return {"vocab_hash": self.schema.vocab_hash, "path": str(self.path),
                "cardinalities": dict(self.schema.cardinalities)}


def open_previous(path: str | os.PathLike, features: Features) -> PreviousVocabulary:
    """The earlier output at `path`, checked before any row is read: a processed-data directory whose
    vocabularies match its schema's hash, made with the same features as `features` (cardinalities
    aside); else a one-line UserError naming the difference."""
    from ctrflow.contract.vocab import load_vocabularies

    where = f"--vocab-from {path}"
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"{where}: no such directory")
    if not (directory / "schema.json").exists():
        raise UserError(f"{where}: no schema.json (not a `ctrflow preprocess` output directory)")
    try:
        schema = Schema.load(directory)
        load_vocabularies(directory)  # its files match its schema's hash
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    diffs = feature_differences(schema.features, features)
    if diffs:
        raise UserError(f"{where}: made from another dataset description: " + "; ".join(diffs[:4])
                        + (f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else ""))
    return PreviousVocabulary(directory.resolve(), schema)


def read_vocab_table(directory: str | os.PathLike, name: str) -> pa.Table:
    """`directory/vocab/<name>.parquet` as (value string, count int64)."""
    table = pq.read_table(Path(directory) / "vocab" / f"{name}.parquet", columns=["value", "count"])
    return pa.table({"value": table.column("value").combine_chunks().cast(pa.string()),
                     "count": table.column("count").combine_chunks().cast(pa.int64())})


def in_sorted(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """bool [n]: which `values` are in `sorted_set` (ascending uint64)."""
    if not len(sorted_set) or not len(values):
        return np.zeros(len(values), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[at] == values


def range_slice(sorted_keys: np.ndarray, i: int, ranges: int, bounds: list) -> slice:
    """The part of ascending `sorted_keys` in hash range `i` of `ranges` (lower `bounds`)."""
    lo = int(np.searchsorted(sorted_keys, bounds[i])) if i else 0
    hi = int(np.searchsorted(sorted_keys, bounds[i + 1])) if i + 1 < ranges else len(sorted_keys)
    return slice(lo, hi)


def grow(previous: pa.Table, day: pa.Table, threshold: int) -> pa.Table:
    """The grown vocabulary (value, count): `previous`'s rows in order, each count plus its count in
    `day`, then `day`'s values not in `previous` that reach `threshold`, in `day`'s order.

    `day`: the new day's merged counts, most frequent first (ties by value), holding every value that
    reaches the threshold and the earlier values whatever their count."""
    old_values, old_counts = _column(previous, "value"), _column(previous, "count")
    day_values, day_counts = _column(day, "value"), _column(day, "count")
    position = pc.index_in(old_values, value_set=day_values)  # null: not seen today
    today = pc.fill_null(day_counts.take(position), 0) if len(day) else pa.array(np.zeros(len(previous), np.int64))
    admitted = pc.and_(pc.invert(pc.is_in(day_values, value_set=old_values)),
                       pc.greater_equal(day_counts, threshold))
    return pa.table({"value": pa.concat_arrays([old_values, day_values.filter(admitted)]),
                     "count": pa.concat_arrays([pc.add(old_counts, today), day_counts.filter(admitted)])})


def _column(table: pa.Table, name: str) -> pa.Array:
    return table.column(name).combine_chunks().cast(pa.string() if name == "value" else pa.int64())
