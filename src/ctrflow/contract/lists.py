"""Multi-hot values: a separated string (or a list) per row → up to `max_length` values, 0-padded ids.

One implementation for preprocessing, predict and serving. A row's text is split at the separator
("Action|Comedy" → "Action", "Comedy"); empty pieces are dropped ("" is an empty list, "a||b" holds
two values), values are kept as written (no trimming), duplicates stay. A list longer than `max_length`
keeps its first `max_length` values (the row counts as truncated: `stats.json` reports them per
feature). Ids follow the vocabulary (1 = rare or unseen), padding is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.features import PADDING_ID


@dataclass
class Lists:
    """Lists of values, dictionary-encoded: `codes[i, k]` is the k-th value of list i as an index into
    `values` (-1: padding); `lengths[i]`: the values list i had before truncation."""

    values: pa.Array  # string [distinct values]
    codes: np.ndarray  # int32 [lists, max_length]
    lengths: np.ndarray  # int64 [lists]

    @property
    def truncated(self) -> np.ndarray:
        """bool [lists]: the list had more than max_length values."""
        return self.lengths > self.codes.shape[1]

    @property
    def empty(self) -> np.ndarray:
        """bool [lists]: no value (a missing multi-hot field)."""
        return self.lengths == 0

    def ids(self, value_ids: np.ndarray) -> np.ndarray:
        """int32 [lists, max_length] ids, given the id of each of `values` (0 where padded)."""
        padded = np.append(np.asarray(value_ids, dtype=np.int32), np.int32(PADDING_ID))
        return padded[np.where(self.codes >= 0, self.codes, len(padded) - 1)]

    def counts(self, weights: np.ndarray) -> np.ndarray:
        """int64 [values]: occurrences of each value (kept ones only), list i counting `weights[i]` times."""
        cells = self.codes >= 0
        per_cell = np.broadcast_to(np.asarray(weights, dtype=np.float64)[:, None], self.codes.shape)[cells]
        return np.bincount(self.codes[cells], weights=per_cell, minlength=len(self.values)).astype(np.int64)


def split_lists(entries: pa.Array, separator: str, max_length: int) -> Lists:
    """Strings (split at `separator`) or lists (values cast to strings) → `Lists` of at most `max_length`
    values each. Nulls are empty lists."""
    entries = entries.combine_chunks() if isinstance(entries, pa.ChunkedArray) else entries
    if pa.types.is_dictionary(entries.type):
        entries = entries.cast(entries.type.value_type)
    if pa.types.is_string(entries.type) or pa.types.is_large_string(entries.type):
        entries = pc.split_pattern(pc.fill_null(entries, ""), separator)
    elif not (pa.types.is_list(entries.type) or pa.types.is_large_list(entries.type)
              or pa.types.is_fixed_size_list(entries.type)):
        raise TypeError(f"multi-hot values must be strings or lists, got {entries.type}")
    n = len(entries)
    flat = entries.flatten()
    parents = pc.list_parent_indices(entries).to_numpy(zero_copy_only=False).astype(np.int64)
    if not pa.types.is_string(flat.type):
        flat = flat.cast(pa.string())
    keep = pc.and_(pc.is_valid(flat), pc.not_equal(pc.fill_null(flat, ""), ""))
    keep = keep.to_numpy(zero_copy_only=False)
    flat, parents = flat.filter(pa.array(keep)), parents[keep]
    lengths = np.bincount(parents, minlength=n).astype(np.int64)
    starts = np.cumsum(lengths) - lengths  # parents ascend: each list's values are contiguous
    position = np.arange(len(parents), dtype=np.int64) - starts[parents]
    kept = position < max_length
    encoded = pc.dictionary_encode(flat.filter(pa.array(kept)))
    codes = np.full((n, max_length), -1, dtype=np.int32)
    codes[parents[kept], position[kept]] = encoded.indices.to_numpy(zero_copy_only=False)
    return Lists(encoded.dictionary, codes, lengths)
