"""Multi-hot values: a separated string (or a list) per row → up to `max_length` values, 0-padded ids.

One implementation for preprocessing, predict and serving. A row's text is split at the separator
("Action|Comedy" → "Action", "Comedy"); empty pieces are dropped ("" is an empty list, "a||b" holds
two values), values are kept as written (no trimming), duplicates stay. A list longer than `max_length`
keeps its first `max_length` values, or its last ones with `keep="last"` (the row counts as truncated:
`stats.json` reports them per feature); the kept values stay in their order. Ids follow the vocabulary
(1 = rare or unseen), padding is 0 (after the values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.features import PADDING_ID

KEEPS = ("first", "last")  # which values a list longer than max_length keeps


@dataclass
class Lists:
    """Lists of values, dictionary-encoded: `codes[i, k]` is the k-th value of list i as an index into
    `values` (-1: padding); `lengths[i]`: the values list i had before truncation."""

    values: pa.Array  # string [distinct values]
    codes: np.ndarray  # int32 [lists, max_length]
    lengths: np.ndarray  # int64 [lists]

    @property
    def empty(self) -> np.ndarray:
        """bool [lists]: no value (a missing multi-hot field)."""
        return self.lengths == 0

    def resized(self, width: int, keep: str = "first") -> "Lists":
        """The same lists in `width` slots: padded, or cut to their first (last) `width` values."""
        have = self.codes.shape[1]
        if have <= width:
            codes = np.full((len(self.codes), width), -1, dtype=np.int32)
            codes[:, :have] = self.codes
            return Lists(self.values, codes, self.lengths)
        if keep == "first":
            return Lists(self.values, np.ascontiguousarray(self.codes[:, :width]), self.lengths)
        held = np.count_nonzero(self.codes >= 0, axis=1)
        slots = np.maximum(held - width, 0)[:, None] + np.arange(width)
        codes = np.take_along_axis(self.codes, np.minimum(slots, have - 1), axis=1)
        return Lists(self.values, np.where(slots < held[:, None], codes, -1).astype(np.int32), self.lengths)

    def ids(self, value_ids: np.ndarray) -> np.ndarray:
        """int32 [lists, max_length] ids, given the id of each of `values` (0 where padded)."""
        padded = np.append(np.asarray(value_ids, dtype=np.int32), np.int32(PADDING_ID))
        return padded[np.where(self.codes >= 0, self.codes, len(padded) - 1)]

    def counts(self, weights: np.ndarray) -> np.ndarray:
        """int64 [values]: occurrences of each value (kept ones only), list i counting `weights[i]` times."""
        cells = self.codes >= 0
        per_cell = np.broadcast_to(np.asarray(weights, dtype=np.float64)[:, None], self.codes.shape)[cells]
        return np.bincount(self.codes[cells], weights=per_cell, minlength=len(self.values)).astype(np.int64)


def split_lists(entries: pa.Array, separator: str, max_length: int | None, keep: str = "first") -> Lists:
    """Strings (split at `separator`) or lists (values cast to strings) → `Lists` of at most `max_length`
    values each (the first ones, or the last with `keep="last"`; None: as many as the longest list has).
    Nulls are empty lists."""
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
    keep_value = pc.and_(pc.is_valid(flat), pc.not_equal(pc.fill_null(flat, ""), ""))
    keep_value = keep_value.to_numpy(zero_copy_only=False)
    flat, parents = flat.filter(pa.array(keep_value)), parents[keep_value]
    lengths = np.bincount(parents, minlength=n).astype(np.int64)
    width = max_length if max_length is not None else max(int(lengths.max(initial=0)), 1)
    starts = np.cumsum(lengths) - lengths  # parents ascend: each list's values are contiguous
    position = np.arange(len(parents), dtype=np.int64) - starts[parents]
    if keep == "last":  # slot 0 holds the list's width-th value from its end
        position -= np.maximum(lengths - width, 0)[parents]
    kept = (position >= 0) & (position < width)
    encoded = pc.dictionary_encode(flat.filter(pa.array(kept)))
    codes = np.full((n, width), -1, dtype=np.int32)
    codes[parents[kept], position[kept]] = encoded.indices.to_numpy(zero_copy_only=False)
    return Lists(encoded.dictionary, codes, lengths)
