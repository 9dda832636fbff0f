"""Evaluation batches: a whole split read in file order, with bounded memory, one share per process.

Day 23 of Criteo-1TB (the validation and test day) is ~178 M rows, ~28 GB as processed Parquet:
no process holds it. Rank r of W scores the contiguous rows [N*r/W, N*(r+1)/W) (with
`limit_batches`, N is at most limit x batch_size: the same first rows as the in-memory loader's),
in batches of batch_size / W rows, through the streaming loader's machinery
(`ctrflow.loaders.window`): threads decode row groups into page-locked windows, one asynchronous copy
per window, batches are slices of the device buffer. Memory: 2 x window x row bytes (160 for
Criteo) on the host and as much on the device, whatever the split's size.

Every process yields the same number of batches (the last ones may be short or empty), so
forward passes with collectives (sharded tables) stay in step.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch

from ctrflow.loaders.batch import Batch
from ctrflow.loaders.stream import default_threads
from ctrflow.loaders.stream_plan import ParquetIndex, ScanPlan
from ctrflow.loaders.window import WindowPipeline
from ctrflow.errors import UserError

SCAN_WINDOW = 1 << 21  # rows per window: 2,097,152 (320 MiB; ~16 row groups of 131,072, one per thread)


class ScanLoader:
    """This process's share of a split, in file order, in batches on `device` (module doc)."""

    def __init__(self, index: ParquetIndex, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 table_sizes: Sequence[int] | None = None, device: torch.device | str | None = None,
                 threads: int | None = None, window_rows: int = SCAN_WINDOW, limit_batches: int | None = None):
        if batch_size <= 0:
            raise UserError(f"--batch-size must be positive, got {batch_size}")
        self.dataset = index
        self.total = len(index) if limit_batches is None else min(len(index), limit_batches * batch_size)
        self.begin, self.end = self.total * rank // world_size, self.total * (rank + 1) // world_size
        self.batch = max(1, batch_size // world_size)
        self.count = -(-(-(-self.total // world_size)) // self.batch)  # the largest share's batches
        self.own_lanes = [0]
        self.sizes = None if table_sizes is None else np.asarray(table_sizes, np.int64)
        self.device = torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.threads = threads or default_threads()
        self.window_rows = window_rows

    def __len__(self) -> int:
        """Batches of every process."""
        return self.count

    def rows(self) -> int:
        """Rows this process scores."""
        return self.end - self.begin

    def plan(self) -> ScanPlan:
        """This process's rows in windows."""
        return ScanPlan(self.dataset, self.batch, self.window_rows, self.begin, self.end)

    def buffer_bytes(self) -> int:
        """Host (page-locked on a GPU) bytes, and as many device bytes, of the two windows in flight."""
        return 2 * self.plan().window * self.dataset.layout.row_bytes

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """Every batch of this process in row order (`epoch`, `start`: as `BatchLoader`'s; evaluation
        passes neither)."""
        plan, done = self.plan(), 0
        if plan.windows:
            pipe = WindowPipeline(self, plan, range(plan.windows))
            try:
                for _, slot in pipe:
                    for lo in range(0, slot.rows, self.batch):
                        if done >= start:
                            yield slot.span(lo, min(lo + self.batch, slot.rows))
                        done += 1
                    pipe.release(slot)
            finally:
                pipe.close()
        for _ in range(max(done, start), self.count):  # shorter shares: empty batches keep collectives in step
            layout = self.dataset.layout
            yield Batch(torch.zeros(0, layout.num_dense, device=self.device),
                        torch.zeros(0, layout.slots, dtype=torch.int64, device=self.device),
                        torch.zeros(0, device=self.device))
