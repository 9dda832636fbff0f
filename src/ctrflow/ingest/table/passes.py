"""The two passes over a described table (CSV, TSV or Parquet), as worker stages (`parallel.WorkerPool`).

Fit: parse a block once (`text_parse` or `parquet_read`), encode it (`encode`: dictionaries, the dense
transform, multi-hot lists), count the training rows' values (`string_counts`), and cache the block
(`blockcache`: in the worker's memory up to a budget, else on disk), so the transform pass never parses
again. Transform: look up each block's dictionaries in the vocabularies, gather ids, write Parquet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ctrflow.contract.description import Description
from ctrflow.ingest.table.encode import encode_block, lookup_block
from ctrflow.contract.formats.parquet_read import ParquetPiece, read_piece
from ctrflow.contract.formats.text_parse import parse_text_block
from ctrflow.ingest.blockcache import CACHE
from ctrflow.errors import UserError
from ctrflow.ingest.counting import SPILL_ENTRIES
from ctrflow.ingest.output import checksums_in, part_schema, pieces_of_range, write_splits
from ctrflow.ingest.parallel import worker_index
from ctrflow.ingest.split import row_keys, rows_in_valid
from ctrflow.ingest.string_counts import StringCounter
from ctrflow.contract.vocab import Vocabularies


@dataclass(frozen=True)
class TextBlock:
    """A task: the whole rows of one CSV/TSV file in bytes [start, end) of `path` (the input, or its
    decompressed copy); block 0 starts with the header's `header_end` bytes."""

    file_index: int
    index: int
    path: str
    start: int
    end: int
    columns: tuple[str, ...]  # every column of the file, in order
    header_end: int = 0
    quoted: bool = False  # the file holds quote characters
    clean: bool = True  # ... all where RFC 4180 puts them (`text_rows`)
    checksum: bool = False  # report the CRC-32 of the input pieces starting in the block (the digest)


@dataclass
class TableFitStage:
    """Pass 1 in a worker: parse, validate, count training values, cache the block."""

    description: Description
    splits: list[str] | dict[int, str]  # per file index: "train", "valid" or "split" (by --valid-fraction)
    cache_dir: str  # "": cache nothing (the per-file count step)
    valid_fraction: float = 0.0
    seed: int = 0
    stop_at_bad_row: bool = True
    run_dir: str = ""
    spill_entries: int = SPILL_ENTRIES
    count: bool = True  # False: parse and cache only (the per-file transform step)
    memory_bytes: int = 0  # this worker's share of the in-memory block cache (0: every block on disk)
    counter: StringCounter | None = None

    def start(self) -> None:
        """Fresh counts and an empty block cache (in the worker)."""
        self.counter = StringCounter(self.run_dir, self.description.sparse, self.spill_entries)
        CACHE.clear()

    def finish(self) -> dict:
        """This worker's run files; nothing when not counting."""
        return self.counter.finish() if self.count else {"runs": [], "other": {}}

    def handle(self, task: TextBlock | ParquetPiece) -> list[dict]:
        """One block's accounting (problems with block-relative lines); caches its rows."""
        result = {"file": task.file_index, "lines": 0, "rows_read": 0, "rows": {"train": 0, "valid": 0},
                  "problems": [], "truncated": False, "tail": b"", "cache": None, "worker": None,
                  "missing": np.zeros(len(self.description.dense) + len(self.description.sparse), np.int64),
                  "lists": {}, "label_sum": 0, "pieces": None}
        split = self.splits[task.file_index]
        if isinstance(task, ParquetPiece):
            table, rows, problems = read_piece(task, self.description)
            result.update(unit="row", lines=len(table) + len(problems), rows_read=len(table) + len(problems))
            keys = rows + task.first_row  # the row's number in its file
        else:
            table, keys, problems = self._parse_text(task, split, result)
        result["problems"] = problems
        if (problems and self.stop_at_bad_row) or table is None or not len(table):
            return [result]
        valid = None
        if split == "split":
            valid = rows_in_valid(self.seed, task.file_index, keys, self.valid_fraction)
            result["rows"] = {"train": int(len(table) - valid.sum()), "valid": int(valid.sum())}
        else:
            result["rows"][split] = len(table)
        encoded = encode_block(table, self.description, valid, split)
        result.update(missing=encoded.missing, lists=encoded.lists, label_sum=encoded.label_sum)
        if self.count:
            for name, (values, counts) in encoded.counts.items():
                self.counter.add(name, values, counts)
            self.counter.spill_if_large()
        result["cache"] = f"{task.file_index:05d}-{task.index:07d}.arrow"
        if self.cache_dir and CACHE.put(self.cache_dir, result["cache"], encoded.table, encoded.side,
                                        self.memory_bytes):
            result["worker"] = worker_index()  # the transform of this block must run there
        return [result]

    def _parse_text(self, task: TextBlock, split: str, result: dict):
        size = os.stat(task.path).st_size
        # the pieces starting in the block may run past its end: read them whole
        stop = pieces_of_range(task.start, task.end, size)[2] if task.checksum else task.end
        data = read_range(task.path, task.start, stop)
        if task.checksum:
            result["pieces"] = checksums_in(data, task.start, task.start, task.end, size)
        length = task.end - task.start
        returns = _BUFFER[0].find(b"\r", 0, length) >= 0  # memchr: the block's bytes start the buffer
        parsed = parse_text_block(data[:length], self.description, list(task.columns), task.header_end, task.quoted,
                                  task.clean, returns=returns)
        result.update(lines=parsed.lines, rows_read=parsed.rows_read, blank_lines=parsed.blank_lines)
        keys = row_keys(parsed.table, self.description.used_columns) if split == "split" and parsed.table is not None else None
        return parsed.table, keys, parsed.problems


_BUFFER = [bytearray()]  # this worker's block buffer, reused: no fresh pages per block


def read_range(path: str, start: int, end: int) -> memoryview:
    """Bytes [start, end) of a file, read into this worker's reused buffer (valid until the next call;
    they are its first `end - start` bytes)."""
    n = end - start
    if len(_BUFFER[0]) < n:
        _BUFFER[0] = bytearray(int(n * 1.25))
    view = memoryview(_BUFFER[0])[:n]
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        got = f.readinto(view)
    if got != n:
        raise UserError(f"{path}: the file changed while it was read (expected {n} bytes at {start}, got {got})")
    return view


@dataclass
class TableTransformStage:
    """Pass 2 in a worker: cached dictionaries → ids, one Parquet part per split present in the block."""

    description: Description
    data_dir: str  # holds the cache, and receives train/ and valid/
    compression: str = "none"
    vocab_dir: str = ""  # holds vocab/ (default: data_dir)
    tables: dict[str, pa.Table] | None = None  # the vocabulary tables themselves (then vocab/ is not read)
    vocab: Vocabularies | None = None

    def start(self) -> None:
        """Load the vocabularies once per worker (the same lookups serving uses)."""
        if self.tables is not None:
            self.vocab = Vocabularies.from_tables(self.tables)
        else:
            self.vocab = Vocabularies.load(self.vocab_dir or self.data_dir, self.description.sparse)

    def finish(self) -> None:
        """Nothing to hand back."""
        return None

    def handle(self, task: tuple[str, dict[str, int], int | None]) -> dict[str, int]:
        """Write the block's parts (task: cache name, part number per split, worker holding it or None);
        returns rows written per split."""
        cache_name, parts, _ = task
        cached, side = CACHE.take(os.path.join(self.data_dir, "cache"), cache_name)
        columns = lookup_block(cached, side, self.description, self.vocab)
        schema = part_schema(self.description.features(dict.fromkeys(self.description.sparse, 0)))
        return write_splits(columns, cached, parts, self.data_dir, self.compression, schema)
