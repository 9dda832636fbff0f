"""The `--valid-fraction` split: a seeded coin per row, the same whatever the blocks, workers or engine."""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def rows_in_valid(seed: int, file_index: int, offsets: np.ndarray, fraction: float) -> np.ndarray:
    """Seeded per-row coin (splitmix64 of seed, file and the row's position in its file: the byte offset
    where a text row starts, the row number in a Parquet file): same for any chunking. bool [n]."""
    with np.errstate(over="ignore"):
        x = offsets.astype(np.uint64) + np.uint64(seed % (1 << 64)) * _GOLDEN + np.uint64(file_index) * _MIX1
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 ** -53) < fraction
