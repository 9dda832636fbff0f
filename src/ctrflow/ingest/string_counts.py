"""Value counts of any strings, out of core: a dataset's categorical and multi-hot values, whatever they are.

Each worker adds, per block and column, the block's distinct values and their counts (from the
dictionary the parser made: a bincount, no hashing of rows). When it holds more than `spill_entries`
(value, count) pairs it merges them (a hash group-by) and writes them to a run file, sorted by a 64-bit
hash of the value (`hash_strings`), then starts afresh: a worker's memory is bounded whatever the input
size. At the end each column's runs are merged range by range of the hash (`range_entries` pairs at a
time; equal values have equal hashes, so they meet in one range), keeping the values that reach the
threshold. The vocabulary's order (most frequent first, ties by value bytes) is a total order: the same
whatever order blocks were counted in.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.ingest.counting import RANGE_ENTRIES, SPILL_ENTRIES
from ctrflow.ingest.growth import grow, range_slice
from ctrflow.contract.hashing import hash_strings

_RUN_SCHEMA = pa.schema([("h", pa.uint64()), ("value", pa.string()), ("count", pa.int64())])


def sum_counts(values: pa.Array, counts: pa.Array) -> tuple[pa.Array, pa.Array]:
    """(distinct values, summed int64 counts) of (value, count) pairs: a hash group-by (a dictionary
    encoding and a bincount: pyarrow's group-by would import its query engine into every worker,
    ~0.05 CPU-s each; float64 sums are exact below 2**53)."""
    if not len(values):
        return values, counts
    encoded = pc.dictionary_encode(values, null_encoding="encode")
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    weights = pc.cast(counts, pa.float64()).to_numpy(zero_copy_only=False)
    sums = np.bincount(indices, weights=weights, minlength=len(encoded.dictionary))
    return encoded.dictionary, pa.array(sums.astype(np.int64))


class StringCounter:
    """A worker's counts of every sparse column's string values, spilled to hash-sorted run files when large."""

    def __init__(self, run_dir: str, columns: Sequence[str], spill_entries: int = SPILL_ENTRIES):
        self.run_dir, self.spill_entries = run_dir, spill_entries
        self.values: dict[str, list[pa.Array]] = {name: [] for name in columns}
        self.counts: dict[str, list[pa.Array]] = {name: [] for name in columns}
        self.entries = 0  # pairs held, duplicates across blocks included
        self.runs: list[str] = []

    def add(self, name: str, values: pa.Array, counts: np.ndarray) -> None:
        """Count one block's values of one column: distinct non-empty strings and their int64 counts (> 0)."""
        if len(values):
            self.values[name].append(values)
            self.counts[name].append(pa.array(counts, pa.int64()))
            self.entries += len(values)

    def spill_if_large(self) -> None:
        """Merge the pending counts when they outgrow the budget, and write a run if they still fill half
        of it (call between blocks)."""
        if self.entries <= self.spill_entries:
            return
        for name in self.values:
            self._compact(name)
        if self.entries > self.spill_entries // 2:
            self.spill()

    def _compact(self, name: str) -> None:
        held = len(self.values[name])
        if held > 1:
            values, counts = sum_counts(pa.concat_arrays(self.values[name]), pa.concat_arrays(self.counts[name]))
            self.values[name], self.counts[name] = [values], [counts]
        if held:
            self.entries = sum(len(v) for parts in self.values.values() for v in parts)

    def spill(self) -> None:
        """Write every column's counts as one run file: one record batch per column, sorted by hash."""
        path = os.path.join(self.run_dir, f"strings-{os.getpid()}-{len(self.runs):05d}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, _RUN_SCHEMA) as writer:
            for name in self.values:
                self._compact(name)
                values = self.values[name][0] if self.values[name] else pa.array([], pa.string())
                counts = self.counts[name][0] if self.counts[name] else pa.array([], pa.int64())
                writer.write_batch(pa.record_batch(list(_sorted_by_hash(values, counts)), schema=_RUN_SCHEMA))
                self.values[name], self.counts[name] = [], []
        self.entries = 0
        self.runs.append(path)

    def finish(self) -> dict:
        """What goes to the merge: the run files, after spilling what is left; a worker that never spilled
        hands its counts over as they are (`other`: column → (values, counts); no hashing, sorting or file)."""
        if self.runs:
            self.spill()
            return {"runs": self.runs, "other": {}}
        held = {}
        for name in self.values:
            self._compact(name)
            if self.values[name]:
                held[name] = (self.values[name][0].cast(pa.string()), self.counts[name][0])
        return {"runs": [], "other": held}


def _sorted_by_hash(values: pa.Array, counts: pa.Array) -> tuple[pa.Array, pa.Array, pa.Array]:
    """(hash uint64, value, count) ordered by the values' hash, as a run file holds them."""
    h = hash_strings(values)
    order = np.argsort(h, kind="stable")
    return pa.array(h[order]), values.cast(pa.string()).take(order), counts.take(order)


def merge_strings(runs: list[str], held: list, column: int, threshold: int, range_entries: int = RANGE_ENTRIES,
                  previous: pa.Table | None = None) -> tuple[pa.Table, int]:
    """Column `column`'s vocabulary from every worker's runs and `held` counts ((values, counts) of the
    workers that never spilled): (table value/count, most frequent first, ties by value bytes; distinct
    values in the training split). `previous`: the earlier vocabulary this one grows (`growth.grow`: its
    values keep their ids, and their counts today are kept too)."""
    parts = []
    for path in runs:
        with pa.memory_map(path) as source:
            batch = pa.ipc.open_file(source).get_batch(column)
        parts.append((batch.column(0).to_numpy(), batch.column(1), batch.column(2)))
    total = sum(len(values) for _, values, _ in parts) + sum(len(values) for values, _ in held)
    ranges = max(1, -(-total // range_entries))
    for values, counts in held:  # in one range as they are; hash-sorted when the merge goes range by range
        h, values, counts = _sorted_by_hash(values, counts) if ranges > 1 else (None, values, counts)
        parts.append((None if h is None else h.to_numpy(), values, counts))
    bounds = [np.uint64(i * (1 << 64) // ranges) for i in range(ranges)]
    kept_values, kept_counts, distinct = [], [], 0
    if previous is not None:  # its values by hash, as the runs are sorted
        earlier = previous.column("value").combine_chunks()
        earlier_h = hash_strings(earlier)
        order = np.argsort(earlier_h, kind="stable")
        earlier_h, earlier = earlier_h[order], earlier.take(pa.array(order))
    for i in range(ranges):
        values, counts = [], []
        for h, part_values, part_counts in parts:
            lo = int(np.searchsorted(h, bounds[i])) if i else 0
            hi = int(np.searchsorted(h, bounds[i + 1])) if i + 1 < ranges else len(part_values)
            values.append(part_values.slice(lo, hi - lo))
            counts.append(part_counts.slice(lo, hi - lo))
        merged_values, merged_counts = sum_counts(pa.concat_arrays(values or [pa.array([], pa.string())]),
                                                  pa.concat_arrays(counts or [pa.array([], pa.int64())]))
        distinct += len(merged_values)
        keep = pc.greater_equal(merged_counts, threshold)
        if previous is not None:  # the earlier values' counts today, whatever they are
            span = range_slice(earlier_h, i, ranges, bounds)
            earlier_here = earlier.slice(span.start, span.stop - span.start)
            keep = pc.or_(keep, pc.is_in(merged_values.cast(pa.string()), value_set=earlier_here))
        kept_values.append(merged_values.filter(keep))
        kept_counts.append(merged_counts.filter(keep))
    table = pa.table({"value": pa.concat_arrays(kept_values).cast(pa.string()),
                      "count": pa.concat_arrays(kept_counts).cast(pa.int64())})
    order = pc.sort_indices(table, sort_keys=[("count", "descending"), ("value", "ascending")])
    table = table.take(order)
    return (table if previous is None else grow(previous, table, threshold)), distinct
