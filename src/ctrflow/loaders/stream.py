"""Out-of-core training batches: Parquet row groups streamed through shuffle windows to the device.

For splits that do not fit in memory (Criteo-1TB's train split is ~670 GB as ctrflow stores it).
Which rows form which global batch is `ctrflow.loaders.stream_plan`'s business; `ctrflow.loaders.window`
moves them: threads decode a window's row groups into a page-locked buffer, one asynchronous copy
takes it to the device, and each batch is one `index_select` there by the window's permutation.

Two windows are in flight (double buffering), so host and device memory are bounded by
`buffer_bytes()` (2 x lanes-of-this-process x window x row bytes, plus the index; a row is 160 B
for Criteo, `ctrflow.loaders.layout`) whatever the split's size. On the CPU the same code runs
without the copy. Resuming at (epoch, batch i) starts at i's window: the skipped windows are not
read. When an epoch is read to its end, the next epoch's first window is filled meanwhile (while
the last window trains and validation runs) in the same buffers, so the next epoch neither waits
for it nor allocates.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np
import torch

from ctrflow.loaders.batch import Batch
from ctrflow.loaders.stream_plan import EpochPlan, ParquetIndex
from ctrflow.loaders.window import WindowPipeline
from ctrflow.errors import UserError
from ctrflow.processes import available_cores

DEFAULT_WINDOW = 1 << 23  # rows shuffled together, all lanes: 8,388,608 (1.25 GiB on each side)
DEFAULT_LANES = 8


def default_threads() -> int:
    """Decode threads for one process: the usable cores shared by the processes of this host, at most 16."""
    cores = available_cores()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, min(16, cores // local))


def choose_loader(mode: str, split_bytes: int, device: torch.device, host_bytes: int | None = None,
                  local_processes: int | None = None) -> str:
    """`"memory"` or `"stream"` for a train split of `split_bytes` (`ParquetIndex.resident_bytes`)
    under `--loader mode`.

    auto: memory when the split is kept on the GPU (at most 1/16 of its memory: 75 M samples/s, an
    exact permutation per epoch); on a GPU otherwise stream (the host-gather fallback gives ~5 M/s);
    on the CPU memory while the split takes at most 1/4 of host memory per process of this host
    (every process reads the whole split), else stream."""
    if mode in ("memory", "stream"):
        return mode
    if mode != "auto":
        raise UserError(f"--loader must be auto, memory or stream, got {mode!r}")
    if device.type == "cuda":
        return "memory" if split_bytes * 16 <= torch.cuda.get_device_properties(device).total_memory else "stream"
    if host_bytes is None:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = local_processes or max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return "memory" if split_bytes * 4 * local <= host_bytes else "stream"


class StreamLoader:
    """Iterates one process's share of the global batches of a split streamed from Parquet.

    Training only (shuffled or not, the last partial batch dropped); evaluation reads in order with
    `ctrflow.loaders.scan.ScanLoader`. `window_rows`: rows shuffled together over all lanes (a lane's
    window is window_rows / lanes rounded down to a whole number of batch shares). `lanes` must be a
    multiple of `world_size` and divide `batch_size`. `epochs`: the run's epochs (none is read ahead
    after the last; None: always read ahead).
    """

    def __init__(self, index: ParquetIndex, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, lanes: int = DEFAULT_LANES, window_rows: int = DEFAULT_WINDOW,
                 table_sizes: Sequence[int] | None = None, device: torch.device | str | None = None,
                 threads: int | None = None, limit_batches: int | None = None, epochs: int | None = None):
        if batch_size <= 0 or lanes <= 0:
            raise UserError(f"--batch-size and --lanes must be positive, got {batch_size} and {lanes}")
        if lanes % world_size:
            raise UserError(f"--lanes {lanes} must be a multiple of the {world_size} processes")
        if batch_size % lanes:
            raise UserError(f"--batch-size {batch_size} must be divisible by --lanes {lanes}")
        self.dataset = index
        self.batch_size, self.seed, self.shuffle, self.lanes = batch_size, seed, shuffle, lanes
        self.rank, self.world_size, self.window_rows = rank, world_size, window_rows
        self.own_lanes = list(range(rank, lanes, world_size))
        self.sizes = None if table_sizes is None else np.asarray(table_sizes, np.int64)
        self.device = torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.threads = threads or default_threads()
        self.limit_batches, self.epochs = limit_batches, epochs
        self._next: tuple[int, WindowPipeline] | None = None  # (epoch, pipeline that prefetched its window 0)

    def __len__(self) -> int:
        """Global batches per epoch."""
        count = (len(self.dataset) // self.lanes) // (self.batch_size // self.lanes)  # as EpochPlan.batches
        return count if self.limit_batches is None else min(count, self.limit_batches)

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's lanes and windows."""
        return EpochPlan(self.dataset, self.batch_size, self.lanes, self.window_rows, self.seed, epoch, self.shuffle)

    def buffer_bytes(self) -> int:
        """Host (page-locked) bytes, and as many device bytes, of the two windows in flight."""
        return 2 * len(self.own_lanes) * self.plan(0).window * (self.dataset.layout.row_bytes + 4)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """Global batches `start`, `start + 1`, ... of `epoch` (this process's rows), on `device`."""
        plan, stop = self.plan(epoch), len(self)
        if start >= stop:
            return
        per = plan.window_batches
        windows = range(start // per, (stop - 1) // per + 1)
        pipe = self._pipeline(epoch, plan, windows)
        finished = False
        try:
            for window, slot in pipe:
                for i in range(max(start, window * per), min(stop, (window + 1) * per)):
                    yield slot.batch(i - window * per)
                pipe.release(slot)
            finished = True
        finally:
            if finished and pipe.lookahead is not None:
                self._next = (epoch + 1, pipe)  # its producer is filling epoch + 1's first window
            else:
                pipe.close()

    def close(self) -> None:
        """Stop a prefetch of the next epoch that will not be read (the buffers go with the loader)."""
        if self._next is not None:
            self._next[1].close()
            self._next = None

    def _pipeline(self, epoch: int, plan: EpochPlan, windows: range) -> WindowPipeline:
        """A pipeline over `windows`, taking over the buffers (and the prefetched first window) of the
        previous epoch's when it read on to this one."""
        lookahead = self.plan(epoch + 1) if self.epochs is None or epoch + 1 < self.epochs else None
        previous, self._next = self._next, None
        if previous is None:
            return WindowPipeline(self, plan, windows, lookahead=lookahead)
        slots, first, carry = previous[1].handover()
        if previous[0] != epoch or windows.start != 0 or first is None:
            return WindowPipeline(self, plan, windows, slots=slots, lookahead=lookahead)
        return WindowPipeline(self, plan, windows[1:], slots=slots, first=first, carry=carry, lookahead=lookahead)
