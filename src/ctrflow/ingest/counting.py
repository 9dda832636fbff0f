"""Value counts of the categorical columns, out of core: merged across blocks, files and workers.

Each worker counts its blocks in memory (each block's distinct keys and counts, from the hash
factorization that also gives the cache its codes) and, when it holds more than
`spill_entries` (value, count) pairs, merges them (a sort by a mixed key, `sum_sorted`) into a run
file and starts afresh; so a worker's memory is bounded whatever the input size. At the end each
column's runs are merged range by range of the mixed key (`range_entries` pairs at a time), keeping
only values that reach the threshold. (Handing a worker's counts back as arrays when they never
spilled, instead of a last run file, was measured slower: they then travel through two pipes.)
The final order (most frequent first, ties by value bytes) is a total order: the vocabulary is the
same whatever order blocks were counted in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.contract.kernels import CpuEngine
from ctrflow.ingest.growth import grow, in_sorted, range_slice, read_vocab_table
from ctrflow.contract.hashing import mix, unmix
from ctrflow.contract.vocab import encode_keys, keys_to_strings

SPILL_ENTRIES = 1 << 20  # (value, count) pairs a worker holds before writing a run (16 MB)
RANGE_ENTRIES = 1 << 20  # pairs of one column merged at once at the end
_CPU = CpuEngine()
_RUN_SCHEMA = pa.schema([("h", pa.uint64()), ("count", pa.int64())])


def sum_sorted(keys: np.ndarray, counts: np.ndarray, runs: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(distinct uint64 keys ascending, their summed int64 counts). A sort, no hash table (a hash
    group-by's growing table cost several times more, most of it fresh pages). `runs`: the keys are
    sorted runs back to back (a stable sort merges them)."""
    order = np.argsort(keys, kind="stable" if runs else None)
    keys, counts = keys[order], counts[order]
    if len(keys) < 2:
        return keys, counts.astype(np.int64)
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    return keys[starts], np.add.reduceat(counts, starts).astype(np.int64)


def _sum_by(keys: pa.Array, counts: pa.Array) -> tuple[pa.Array, pa.Array]:
    if not len(keys):  # most columns have no "other" string: skip the group-by's fixed cost
        return keys, counts
    table = pa.table({"k": keys, "c": counts}).group_by("k", use_threads=False).aggregate([("c", "sum")])
    return table.column("k").combine_chunks(), table.column("c_sum").combine_chunks()


class ValueCounts:
    """In-memory counts of one column: uint64 keys (8-byte values) and other strings."""

    def __init__(self) -> None:
        self.keys: list[np.ndarray] = []  # per block: mixed keys (`mix`), then one sorted set once compacted
        self.key_counts: list[np.ndarray] = []
        self.sorted = True  # `keys` is one sorted set of distinct keys (or nothing)
        self.other: list[pa.Array] = [pa.array([], pa.string())]
        self.other_counts: list[pa.Array] = [pa.array([], pa.int64())]
        self.entries = 0  # pairs held, duplicates across blocks included (merged only when spilled)

    def add(self, keys: np.ndarray, other: pa.Array | None = None) -> None:
        """Count one block's values (`encode_keys` output; a sort, fast on integers); key 0
        (missing / other) is skipped."""
        self.add_counts(*_CPU.unique_counts(keys), other)

    def add_counts(self, values: np.ndarray, counts: np.ndarray, other: pa.Array | None = None) -> None:
        """Count one block's distinct non-zero uint64 keys (`counts` int64 > 0) and other strings."""
        self.keys.append(mix(values))
        self.key_counts.append(counts)
        self.sorted = False
        self.entries += len(values)
        if other is not None and other.null_count < len(other):
            found = pc.value_counts(other.drop_null())
            self.other.append(found.field("values"))
            self.other_counts.append(found.field("counts").cast(pa.int64()))

    def compact(self) -> None:
        """Merge pending counts into one (key, count) set."""
        if not self.sorted:
            keys, counts = sum_sorted(np.concatenate(self.keys), np.concatenate(self.key_counts))
            self.keys, self.key_counts, self.sorted = [keys], [counts], True
        if len(self.other) > 1:
            other, counts = _sum_by(pa.concat_arrays(self.other), pa.concat_arrays(self.other_counts))
            self.other, self.other_counts = [other], [counts]
        self.entries = len(self.keys[0]) if self.keys else 0

    def take_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """(mixed keys ascending, counts) of the 8-byte values, which are then forgotten."""
        self.compact()
        if not self.keys:
            return np.empty(0, np.uint64), np.empty(0, np.int64)
        h, counts = self.keys[0], self.key_counts[0]
        self.keys, self.key_counts = [], []
        self.entries = 0
        return h, counts


class Counter:
    """A worker's counts of every categorical column, spilled to sorted run files when large."""

    def __init__(self, run_dir: str, columns: Sequence[str], spill_entries: int = SPILL_ENTRIES):
        self.run_dir, self.spill_entries = run_dir, spill_entries
        self.columns = {name: ValueCounts() for name in columns}
        self.runs: list[str] = []

    def add(self, name: str, keys: np.ndarray, other: pa.Array | None = None) -> None:
        """Count one block's values of one column."""
        self.columns[name].add(keys, other)

    def add_counts(self, name: str, values: np.ndarray, counts: np.ndarray, other: pa.Array | None = None) -> None:
        """Count one block's distinct keys of one column, already counted (`ValueCounts.add_counts`)."""
        self.columns[name].add_counts(values, counts, other)

    def spill_if_large(self) -> None:
        """Write a run when the counts held outgrow the budget (call between blocks)."""
        if sum(c.entries for c in self.columns.values()) > self.spill_entries:
            self.spill()

    def spill(self) -> None:
        """Write every column's key counts as one run file: one record batch per column, sorted."""
        path = os.path.join(self.run_dir, f"run-{os.getpid()}-{len(self.runs):05d}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, _RUN_SCHEMA) as writer:
            for column in self.columns.values():
                h, counts = column.take_keys()
                writer.write_batch(pa.record_batch([pa.array(h), pa.array(counts)], schema=_RUN_SCHEMA))
        self.runs.append(path)

    def finish(self) -> dict:
        """Spill what is left; the run files and the (few) other-string counts go to the merge."""
        self.spill()
        other = {}
        for name, column in self.columns.items():
            column.compact()
            other[name] = (column.other[0], column.other_counts[0])
        return {"runs": self.runs, "other": other}


def merge_vocabulary(runs: list[str], others: list[tuple[pa.Array, pa.Array]], column: int, threshold: int,
                     range_entries: int = RANGE_ENTRIES, previous: pa.Table | None = None) -> tuple[pa.Table, int]:
    """Column `column`'s vocabulary from every worker's runs: (table value/count, most frequent first,
    ties by value bytes; distinct values in the training split). `previous`: the earlier vocabulary
    this one grows (`growth.grow`: its values keep their ids, and their counts today are kept too)."""
    parts = []
    for path in runs:
        with pa.memory_map(path) as source:
            batch = pa.ipc.open_file(source).get_batch(column)
        parts.append((batch.column(0).to_numpy(), batch.column(1).to_numpy()))
    total = sum(len(h) for h, _ in parts)
    ranges = max(1, -(-total // range_entries))
    bounds = [np.uint64(i * (1 << 64) // ranges) for i in range(ranges)]
    kept_h, kept_counts, distinct = [], [], 0
    earlier_h, earlier_other = _earlier_values(previous)
    for i in range(ranges):
        pieces = []
        for h, counts in parts:
            lo = np.searchsorted(h, bounds[i]) if i else 0
            hi = np.searchsorted(h, bounds[i + 1]) if i + 1 < ranges else len(h)
            pieces.append((h[lo:hi], counts[lo:hi]))
        if len(pieces) == 1:  # one run: its keys are distinct already
            h, counts = pieces[0]
        else:
            h, counts = sum_sorted(np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces]),
                                   runs=True)
        distinct += len(h)
        keep = counts >= threshold
        if previous is not None:  # the earlier values' counts today, whatever they are
            keep |= in_sorted(h, earlier_h[range_slice(earlier_h, i, ranges, bounds)])
        kept_h.append(h[keep])
        kept_counts.append(counts[keep])
    other, other_counts = _sum_by(pa.concat_arrays([o[0] for o in others] or [pa.array([], pa.string())]),
                                  pa.concat_arrays([o[1] for o in others] or [pa.array([], pa.int64())]))
    distinct += len(other)
    keep = pc.greater_equal(other_counts, threshold)
    if previous is not None:
        keep = pc.or_(keep, pc.is_in(other, value_set=earlier_other))
    table = pa.table({
        "value": pa.concat_arrays([keys_to_strings(unmix(np.concatenate(kept_h))), other.filter(keep)]),
        "count": pa.concat_arrays([pa.array(np.concatenate(kept_counts).astype(np.int64)),
                                   other_counts.filter(keep)]),
    })
    order = pc.sort_indices(table, sort_keys=[("count", "descending"), ("value", "ascending")])
    table = table.take(order)
    return (table if previous is None else grow(previous, table, threshold)), distinct


def _earlier_values(previous: pa.Table | None) -> tuple[np.ndarray, pa.Array]:
    """An earlier vocabulary's 8-byte values as ascending mixed keys (the runs' order), and its other strings."""
    if previous is None:
        return np.empty(0, np.uint64), pa.array([], pa.string())
    keys, other = encode_keys(previous.column("value"))
    other = pa.array([], pa.string()) if other is None else other.drop_null()
    return np.sort(mix(keys[keys != 0])), other


@dataclass
class MergeStage:
    """One column's vocabulary per task (column, the workers' held or other-string counts of it) on pool
    workers (`parallel.Stage`): the columns merge in parallel processes, not threads holding one GIL.
    `merge` is Criteo's 8-byte-key merge (`merge_vocabulary`) or any strings' (`string_counts.merge_strings`)."""

    runs: list[str]
    thresholds: Sequence[int]  # per column
    range_entries: int = RANGE_ENTRIES
    previous: str = ""  # `--vocab-from`: the processed data whose vocabularies grow ("": none)
    names: Sequence[str] = ()  # the columns in order (their vocabulary files there)
    merge: Callable[..., tuple[pa.Table, int]] = merge_vocabulary

    def start(self) -> None:
        """Nothing to prepare."""

    def handle(self, task: tuple[int, list]) -> tuple[pa.Table, int]:
        """(vocabulary table, distinct values) of one column."""
        column, held = task
        previous = read_vocab_table(self.previous, self.names[column]) if self.previous else None
        return self.merge(self.runs, held, column, self.thresholds[column], self.range_entries, previous)

    def finish(self) -> None:
        """Nothing to hand back."""


def remove_runs(runs: list[str]) -> None:
    """Delete run files once merged."""
    for path in runs:
        Path(path).unlink(missing_ok=True)
