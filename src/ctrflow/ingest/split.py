"""The `--valid-fraction` split: a seeded coin per row, the same whatever the blocks, workers or engine.

A row's coin is splitmix64 of the seed, its file's index and a key of the row. Criteo's key is the byte
offset where the row starts. A described text table's key is its row's described values (label, dense
numbers, categorical and multi-hot texts, hashed): so the split is the same whatever the line endings
(LF, CRLF), a byte order mark, quoting or the columns the description does not name, and rows equal in
every described column fall in the same split. A Parquet table's key is the row's number in its file.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.hashing import hash_strings, mix

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_MISSING = np.uint64(0x5BD1E9955BD1E995)  # the hash of a missing value


def rows_in_valid(seed: int, file_index: int, keys: np.ndarray, fraction: float) -> np.ndarray:
    """Seeded per-row coin (splitmix64 of seed, file and the row's key: `row_keys`, a byte offset or a row
    number): same for any chunking. bool [n]."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.uint64) + np.uint64(seed % (1 << 64)) * _GOLDEN + np.uint64(file_index) * _MIX1
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 ** -53) < fraction


def row_keys(table: pa.Table, columns) -> np.ndarray:
    """uint64 [n]: a hash of each row's values in `columns` (numbers by value, texts by their bytes;
    dictionary-encoded columns hash each distinct value once)."""
    keys = np.zeros(len(table), dtype=np.uint64)
    for name in columns:
        with np.errstate(over="ignore"):
            keys = mix(keys * _MIX1 + _column_hashes(table.column(name)))
    return keys


def _column_hashes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(column.type):
        hashes = np.append(hash_strings(column.dictionary.cast(pa.string())), _MISSING)
        indices = column.indices
        return hashes[(pc.fill_null(indices, -1) if indices.null_count else indices).to_numpy(zero_copy_only=False)]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return np.where(column.is_null().to_numpy(zero_copy_only=False), _MISSING,
                        hash_strings(pc.fill_null(column, "")))
    values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)  # a null is NaN
    return mix(np.ascontiguousarray(values).view(np.uint64))
