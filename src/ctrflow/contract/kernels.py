"""The CPU kernels of the raw -> ids transform: counting, vocabulary lookup and the dense transform in
numpy, used by preprocessing's "cpu" engine and by serving alike.

The "gpu" engine (`ctrflow.ingest.criteo.gpu_engine`) gives bit-identical results, so the output is
the same whatever the hardware: value counts are exact integers, lookups are exact matches against
the same vocabulary, and the dense transform is computed in float64 and rounded once to float32 (a
correctly rounded result, identical in numpy and torch on any device); the gpu engine uses this
module's log1p table.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.features import OOV_ID

LOG1P_TABLE_SIZE = 1 << 16
# log1p of the small integers (most dense values), each computed in float64 and rounded once
_LOG1P_TABLE = np.log1p(np.arange(LOG1P_TABLE_SIZE, dtype=np.float64)).astype(np.float32)


def dense_inputs(columns: Sequence[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """int64 columns (null = missing) → int64 [columns, n] (column-major), missing → 0."""
    n = len(columns[0]) if columns else 0
    out = np.empty((len(columns), n), dtype=np.int64)
    for j, column in enumerate(columns):
        out[j] = pc.fill_null(column, 0).to_numpy(zero_copy_only=False)
    return out


class CpuEngine:
    """numpy: sort-based counting, hash lookup (pandas), float64 log1p."""

    name = "cpu"

    def unique_counts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(distinct non-zero uint64 keys, int64 counts), in any order."""
        values, counts = np.unique(keys[keys != 0], return_counts=True)
        return values, counts.astype(np.int64)

    def factorize(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(codes int32 [n], distinct uint64 keys [u]) with keys == uniques[codes] (hash-based)."""
        import pandas as pd

        codes, uniques = pd.factorize(keys)
        return codes.astype(np.int32), np.asarray(uniques, dtype=np.uint64)

    def transform_dense(self, raw: np.ndarray, overwrite: bool = False) -> np.ndarray:
        """int64 (any shape) → float32, same shape: log1p(max(x, 0)); small values from a table.
        `overwrite`: `raw` may be clipped in place (no second int64 array)."""
        large = raw >= LOG1P_TABLE_SIZE
        big = raw[large] if large.any() else None
        clipped = np.clip(raw, 0, LOG1P_TABLE_SIZE - 1, out=raw if overwrite else None)
        out = _LOG1P_TABLE.take(clipped)
        if big is not None:
            out[large] = np.log1p(big.astype(np.float64)).astype(np.float32)
        return out

    def lookup(self, table: "KeyTable", keys: np.ndarray) -> np.ndarray:
        """Ids (int32) of uint64 keys: the vocabulary's id, or OOV_ID when absent."""
        return table.ids[table.index.get_indexer(keys)]  # -1 picks the last entry, OOV_ID


class KeyTable:
    """One column's 8-byte vocabulary keys and their ids, ready for `CpuEngine.lookup`."""

    def __init__(self, keys: np.ndarray, ids: np.ndarray):
        import pandas as pd

        self.index = pd.Index(keys)
        self.ids = np.append(ids, OOV_ID).astype(np.int32)
