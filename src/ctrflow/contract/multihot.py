"""Criteo with MLPerf DLRMv2's multi-hot features: the seeded expansion of one value into a bag.

MLPerf Training's DLRMv2 makes its multi-hot Criteo from the one-hot logs (TorchRec's
`materialize_synthetic_multihot_dataset.py` in the reference): feature k of multi-hot size h keeps a
row's value as the first id of its bag and adds h - 1 ids drawn uniformly over the feature's table,
a fixed function of (k, value), so that equal values always expand to equal bags. ctrflow's
expansion (`expand`) follows the same rule with a generator of its own: the added ids are a hash of
(key, value, position), not rows of a drawn table (a table of 40 M rows x 99 draws would take 16 GB),
so any value expands without a table, in any process, in any order. The features of hotness 1 stay
categorical.
"""

from __future__ import annotations

import numpy as np

from ctrflow.contract.hashing import mix

# MLPerf Training DLRMv2: the multi-hot size of each of Criteo's 26 categorical features, in order
HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
SEPARATOR = "|"  # between the values of a multi-hot field in the raw files
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / the golden ratio: spreads consecutive integers apart


def expand(values: np.ndarray, length: int, low: int, high: int, key: int) -> np.ndarray:
    """values [n] (integers >= 0) -> [n, length]: column 0 the values, the other columns drawn uniformly
    in [low, high) by a hash of (key, value, column) (module doc)."""
    out = np.empty((len(values), length), dtype=np.int64)
    out[:, 0] = values
    if length > 1:
        with np.errstate(over="ignore"):  # wrapping arithmetic
            column = np.arange(1, length, dtype=np.uint64) * GOLDEN
            seed = mix(values.astype(np.uint64) ^ np.uint64(key & 0xFFFFFFFFFFFFFFFF))
            drawn = mix(seed[:, None] + column[None, :])
        out[:, 1:] = low + (drawn % np.uint64(max(high - low, 1))).astype(np.int64)
    return out


def feature_key(seed: int, feature: int) -> int:
    """The hash key of feature `feature`'s expansion under `seed`."""
    with np.errstate(over="ignore"):
        return int(mix(np.array([seed * 1_000_003 + feature], dtype=np.uint64) + GOLDEN)[0])
