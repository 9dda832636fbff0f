"""The two passes of preprocessing, as worker stages (see `parallel.WorkerPool`).

Fit: parse a block once, transform its dense and label columns, factorize each categorical column
(int32 codes per row, the block's distinct 8-byte keys), count the training rows' values from the
codes, and cache the block (`blockcache`: in the worker's memory up to a budget, else Arrow IPC
files), so the transform pass never parses text again. Transform: look up each block's distinct keys
once in the vocabulary, gather the ids by code, write Parquet. These are the CPU engine's passes;
categorify and the dense transform use its numpy kernels (`contract.kernels.CpuEngine`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from ctrflow.ingest.blockcache import CACHE
from ctrflow.ingest.counting import SPILL_ENTRIES, Counter
from ctrflow.ingest.blocks import Block, plan_blocks, read_block
from ctrflow.ingest.criteo.raw import count_lines, line_starts, parse_block
from ctrflow.contract.kernels import CpuEngine, dense_inputs
from ctrflow.ingest.output import VALID, part_schema, piece_checksums, write_splits
from ctrflow.ingest.parallel import worker_index
from ctrflow.ingest.split import rows_in_valid
from ctrflow.ingest.table.passes import TableTransformStage
from ctrflow.contract.schema import LABEL
from ctrflow.contract.criteo import DENSE, SPARSE, criteo_features
from ctrflow.contract.vocab import encode_keys

_KERNELS = CpuEngine()
_PART_SCHEMA = part_schema(criteo_features(dict.fromkeys(SPARSE, 0)))


@dataclass(frozen=True)
class WholeFile:
    """A task: all blocks of one file, read by the worker itself (gzip decompression in parallel)."""

    file_index: int
    block_bytes: int


@dataclass
class FitStage:
    """Pass 1 in a worker: parse, validate, count training values, cache the block."""

    paths: list[str] | dict[int, str]  # by file index
    splits: list[str] | dict[int, str]  # per file: "train", "valid" or "split" (by --valid-fraction)
    cache_dir: str  # "": cache nothing (the per-file count step)
    valid_fraction: float = 0.0
    seed: int = 0
    stop_at_bad_row: bool = True
    run_dir: str = ""
    spill_entries: int = SPILL_ENTRIES
    count: bool = True  # False: parse and cache only (the per-file transform step)
    # This worker's share of the in-memory block cache; > 0 only where the transform pass runs on the same
    # workers (`preprocess`). 0: every block on disk.
    memory_bytes: int = 0
    checksums: bool = False  # report the CRC-32 of the input pieces starting in each plain block (the digest)
    counter: Counter | None = None

    def start(self) -> None:
        """Fresh counts and an empty block cache (in the worker)."""
        self.counter = Counter(self.run_dir, SPARSE, self.spill_entries)
        CACHE.clear()

    def finish(self) -> dict:
        """This worker's run files (and other-string counts); nothing when not counting."""
        return self.counter.finish() if self.count else {"runs": [], "other": {}}

    def handle(self, task: Block | WholeFile) -> list[dict]:
        """Process a block, or every block of a (gzip) file in order; one accounting dict per block."""
        if isinstance(task, Block):
            return [self._handle_block(task)]
        results = []
        for block in plan_blocks(Path(self.paths[task.file_index]), task.file_index, task.block_bytes):
            results.append(self._handle_block(block))
            if results[-1]["truncated"] or (results[-1]["problems"] and self.stop_at_bad_row):
                break
        return results

    def _handle_block(self, block: Block) -> dict:
        """One block's accounting (and problems, with block-relative lines); caches its rows."""
        path = Path(self.paths[block.file_index])
        result = {"file": block.file_index, "lines": 0, "rows": {"train": 0, "valid": 0},
                  "problems": [], "truncated": block.truncated, "tail": b"", "cache": None, "worker": None,
                  "missing": np.zeros(len(DENSE) + len(SPARSE), dtype=np.int64), "pieces": None}
        if self.checksums and block.data is None:  # first touch of the block's pages: the parse finds them mapped
            result["pieces"] = piece_checksums(path, block.start, block.end)
        begin, data = read_block(path, block)
        if block.truncated:
            result["tail"], result["lines"] = data, count_lines(data)
            return result
        parsed = parse_block(data, binary=True)
        result["problems"], result["lines"] = parsed.problems, parsed.lines
        n = len(parsed.rows)
        if (parsed.problems and self.stop_at_bad_row) or n == 0:
            return result
        split = self.splits[block.file_index]
        valid = None
        if split == "split":
            offsets = line_starts(data)[parsed.rows] + begin
            valid = rows_in_valid(self.seed, block.file_index, offsets, self.valid_fraction)
            result["rows"] = {"train": int(n - valid.sum()), "valid": int(valid.sum())}
        else:
            result["rows"][split] = n
        table, uniques = self._encode_and_count(parsed, split, valid, result["missing"])
        if split != "valid":  # the training rows' clicks: the label rate in schema.json
            result["label_sum"] = int(np.count_nonzero(parsed.label if valid is None else parsed.label[~valid]))
        result["cache"] = f"{block.file_index:05d}-{block.index:07d}.arrow"
        if self.cache_dir and CACHE.put(self.cache_dir, result["cache"], table, uniques, self.memory_bytes):
            result["worker"] = worker_index()  # the transform of this block must run there
        if self.count:
            self.counter.spill_if_large()
        return result

    def _encode_and_count(self, parsed, split: str, valid: np.ndarray | None,
                          missing: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        """The block to cache (label, transformed dense, categorical keys factorized: int32 codes per row
        and each column's distinct keys, back to back); counts the training rows."""
        columns = {LABEL: pa.array(parsed.label.astype(np.float32))}
        dense = _KERNELS.transform_dense(dense_inputs(parsed.dense), overwrite=True)
        for j, name in enumerate(DENSE):
            columns[name] = pa.array(dense[j])  # [13, n]: each row contiguous, no copy
            missing[j] = parsed.dense[j].null_count
        train = None if valid is None else pa.array(~valid)
        distinct, offsets = [], [0]
        for j, name in enumerate(SPARSE):
            keys, other = (parsed.keys[j], None) if parsed.keys else encode_keys(parsed.sparse[j])
            codes, uniques = _KERNELS.factorize(keys)
            columns[name] = pa.array(codes)
            distinct.append(uniques)
            offsets.append(offsets[-1] + len(uniques))
            counts = np.bincount(codes, minlength=len(uniques))
            missing[len(DENSE) + j] = int(counts[uniques == 0].sum())
            if other is not None:
                columns[f"{name}_other"] = other
                missing[len(DENSE) + j] -= len(other) - other.null_count
            if self.count and split != "valid":
                if split == "split":
                    counts = np.bincount(codes[~valid], minlength=len(uniques))
                    other = None if other is None else other.filter(train)
                keep = (uniques != 0) & (counts > 0)
                self.counter.add_counts(name, uniques[keep], counts[keep].astype(np.int64), other)
        if valid is not None:
            columns[VALID] = pa.array(valid)
        table = pa.table(columns).replace_schema_metadata({"key_offsets": json.dumps(offsets)})
        return table, np.concatenate(distinct)


class TransformStage(TableTransformStage):
    """Pass 2 in a worker: cached keys → ids, one Parquet part per split present in the block (the
    described table's stage, `description` Criteo's, with the lookup of factorized 8-byte keys)."""

    def handle(self, task: tuple[str, dict[str, int], int | None]) -> dict[str, int]:
        """Write the block's parts (task: cache name, part number per split, worker holding it or None);
        returns rows written per split."""
        cache_name, parts, _ = task
        cached, uniques = CACHE.take(os.path.join(self.data_dir, "cache"), cache_name)
        offsets = json.loads(cached.schema.metadata[b"key_offsets"])
        names = set(cached.column_names)
        columns = {name: cached.column(name).combine_chunks() for name in (LABEL, *DENSE)}
        for j, name in enumerate(SPARSE):
            other = cached.column(f"{name}_other").combine_chunks() if f"{name}_other" in names else None
            codes = cached.column(name).to_numpy()
            ids = self.vocab.columns[name].lookup_codes(codes, uniques[offsets[j]:offsets[j + 1]], other)
            columns[name] = pa.array(ids)
        return write_splits(columns, cached, parts, self.data_dir, self.compression, _PART_SCHEMA)
