"""64-bit hashing: splitmix64's bijection of uint64 keys (`mix`, `unmix`), hashes of strings, and an exact
string index built on them, with numpy over Arrow buffers.

Counting spills values by hash range (`counting`, `string_counts`); vocabularies look values up by hash
and then compare the bytes, so a hash collision can cost time, never a wrong id.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64: a bijection that spreads keys evenly
_INV1, _INV2 = pow(_M1, -1, 1 << 64), pow(_M2, -1, 1 << 64)
_PRIME = np.uint64(0x100000001B3)  # FNV's 64-bit prime: odd, so every power is invertible mod 2**64


def mix(keys: np.ndarray) -> np.ndarray:
    """uint64 keys → evenly spread uint64 (invertible: `unmix`)."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
        return x ^ (x >> np.uint64(31))


def unmix(x: np.ndarray) -> np.ndarray:
    """The inverse of `mix`."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64)
        x = (x ^ (x >> np.uint64(31)) ^ (x >> np.uint64(62))) * np.uint64(_INV2)
        x = (x ^ (x >> np.uint64(27)) ^ (x >> np.uint64(54))) * np.uint64(_INV1)
        return x ^ (x >> np.uint64(30)) ^ (x >> np.uint64(60))


_CHUNK = 1 << 20  # values hashed at once: bounds the temporaries (8 bytes per value byte)


def hash_strings(values: pa.Array) -> np.ndarray:
    """64-bit hashes (uint64 [n]) of strings: a polynomial over each value's bytes, then splitmix64's
    finalizer (`mix`); computed with numpy over the Arrow buffers, no Python object per value."""
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if values.type != pa.large_string():
        values = values.cast(pa.large_string())
    if len(values) > _CHUNK:
        return np.concatenate([hash_strings(values.slice(at, _CHUNK)) for at in range(0, len(values), _CHUNK)])
    n = len(values)
    _, offsets_buf, data_buf = values.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=n + 1, offset=values.offset * 8)
    lengths = np.diff(offsets).astype(np.uint64)
    total = int(offsets[-1] - offsets[0])
    sums = np.zeros(n, dtype=np.uint64)
    if total:
        data = np.frombuffer(data_buf, dtype=np.uint8, count=total, offset=int(offsets[0]))
        starts = offsets[:-1] - offsets[0]
        position = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths.astype(np.int64))
        powers = np.cumprod(np.full(int(lengths.max()), _PRIME, dtype=np.uint64))  # wraps mod 2**64
        with np.errstate(over="ignore"):
            terms = (data.astype(np.uint64) + np.uint64(1)) * powers[position]
        nonempty = lengths > 0
        sums[nonempty] = np.add.reduceat(terms, starts[nonempty])
    with np.errstate(over="ignore"):
        return mix(sums ^ (lengths * np.uint64(0x9E3779B97F4A7C15)))


class StringIndex:
    """Positions of strings in a fixed array of distinct strings (a vocabulary): a sorted array of their
    hashes searched with numpy, each match confirmed by comparing the bytes."""

    def __init__(self, values: pa.Array):
        values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        self.values = values.cast(pa.string()) if values.type != pa.string() else values
        hashes = hash_strings(self.values)
        self.order = np.argsort(hashes, kind="stable")
        self.hashes = hashes[self.order]
        self.distinct = len(hashes) < 2 or bool(np.all(self.hashes[1:] != self.hashes[:-1]))

    def positions(self, strings: pa.Array) -> np.ndarray:
        """int64 [n]: each string's position in `values`, or -1 where it is absent."""
        strings = strings.combine_chunks() if isinstance(strings, pa.ChunkedArray) else strings
        if not self.distinct:  # two values share a hash (never seen in practice): Arrow's own lookup
            found = pc.index_in(strings, value_set=self.values)
            return pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64)
        out = np.full(len(strings), -1, dtype=np.int64)
        if not len(self.hashes) or not len(strings):
            return out
        wanted = hash_strings(strings)
        at = np.minimum(np.searchsorted(self.hashes, wanted), len(self.hashes) - 1)
        candidate = np.flatnonzero(self.hashes[at] == wanted)
        if len(candidate):
            positions = self.order[at[candidate]]
            same = pc.equal(self.values.take(pa.array(positions)), strings.cast(pa.string()).take(pa.array(candidate)))
            same = same.to_numpy(zero_copy_only=False)
            out[candidate[same]] = positions[same]
        return out
