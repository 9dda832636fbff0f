"""Out-of-core training batches: Parquet row groups streamed through shuffle windows to the device.

For splits that do not fit in memory (Criteo-1TB's train split is ~670 GB as ctrflow stores it).
Which rows form which global batch is `ctrflow.data.stream_plan`'s business; this module moves
them. Per window (every lane of this process, `window` rows each):

1. a pool of threads decodes the window's row groups (pyarrow releases the GIL) and copies each
   column, contiguous, into a page-locked host buffer [40, lanes * window] of 32-bit words (ids
   checked against their tables on the way); the window's permutations are drawn there too;
2. one asynchronous host-to-device copy of that buffer (and of the batch index) on a side stream;
3. each batch is one `index_select` of the device buffer by the window's permuted indices, then
   split into dense / ids / labels: no per-row work on the host.

Two windows are in flight (double buffering): one consumed on the device while the threads fill the
next, so host and device memory are bounded by `buffer_bytes()` (2 x lanes-of-this-process x
window x 160 B, plus the index) whatever the split's size. On the CPU the same code runs without
the copy. Resuming at (epoch, batch i) starts at i's window: the skipped windows are not read.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch

from ctrflow.data.batch import Batch
from ctrflow.data.schema import SPARSE
from ctrflow.data.stream_plan import COLUMNS, FIRST_ID_COLUMN, ROW_BYTES, EpochPlan, ParquetIndex
from ctrflow.errors import UserError

DEFAULT_WINDOW = 1 << 23  # rows shuffled together, all lanes: 8,388,608 (1.25 GiB on each side)
DEFAULT_LANES = 8


def default_threads() -> int:
    """Decode threads for one process: the usable cores shared by the processes of this host, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(1, min(16, cores // local))


def choose_loader(mode: str, split_bytes: int, device: torch.device, host_bytes: int | None = None,
                  local_processes: int | None = None) -> str:
    """`"memory"` or `"stream"` for a train split of `split_bytes` (160 a row) under `--loader mode`.

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
    `BatchLoader`. `window_rows`: rows shuffled together over all lanes (a lane's window is
    window_rows / lanes rounded down to a whole number of batch shares). `lanes` must be a multiple
    of `world_size` and divide `batch_size`.
    """

    def __init__(self, index: ParquetIndex, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, lanes: int = DEFAULT_LANES, window_rows: int = DEFAULT_WINDOW,
                 table_sizes: Sequence[int] | None = None, device: torch.device | str | None = None,
                 threads: int | None = None, limit_batches: int | None = None):
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
        self.limit_batches = limit_batches

    def __len__(self) -> int:
        """Global batches per epoch."""
        count = (len(self.dataset) // self.lanes) // (self.batch_size // self.lanes)  # as EpochPlan.batches
        return count if self.limit_batches is None else min(count, self.limit_batches)

    def plan(self, epoch: int) -> EpochPlan:
        """The epoch's lanes and windows."""
        return EpochPlan(self.dataset, self.batch_size, self.lanes, self.window_rows, self.seed, epoch, self.shuffle)

    def buffer_bytes(self) -> int:
        """Host (page-locked) bytes, and as many device bytes, of the two windows in flight."""
        return 2 * len(self.own_lanes) * self.plan(0).window * (ROW_BYTES + 4)

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """Global batches `start`, `start + 1`, ... of `epoch` (this process's rows), on `device`."""
        plan, stop = self.plan(epoch), len(self)
        if start >= stop:
            return
        per = plan.window_batches
        windows = range(start // per, (stop - 1) // per + 1)
        pipe = _Pipeline(self, plan, windows)
        try:
            for window, slot in pipe:
                for i in range(max(start, window * per), min(stop, (window + 1) * per)):
                    yield slot.batch(i - window * per)
                pipe.release(slot)
        finally:
            pipe.close()


class _Slot:
    """One window's buffers: host [40, lanes * window] int32 words (+ batch index), and their device copies."""

    def __init__(self, lanes: int, window: int, lane_batch: int, device: torch.device):
        pinned = device.type == "cuda"
        shape, index_shape = (len(COLUMNS), lanes * window), (window // lane_batch, lanes * lane_batch)
        self.host = torch.empty(shape, dtype=torch.int32, pin_memory=pinned)
        self.host_index = torch.empty(index_shape, dtype=torch.int32, pin_memory=pinned)
        self.data, self.index = self.host, self.host_index
        self.copied = self.freed = None
        if pinned:
            self.data = torch.empty(shape, dtype=torch.int32, device=device)
            self.index = torch.empty(index_shape, dtype=torch.int32, device=device)
            self.copied, self.freed = torch.cuda.Event(), torch.cuda.Event()

    def batch(self, k: int) -> Batch:
        """The window's k-th batch: one gather of the [40, n] words, then dense / ids / labels."""
        words = self.data.index_select(1, self.index[k])  # [40, rows of this process]
        dense = words[1:FIRST_ID_COLUMN].view(torch.float32).t().contiguous()  # [n, 13]
        sparse = words[FIRST_ID_COLUMN:].t().to(torch.int64, memory_format=torch.contiguous_format)  # [n, 26]
        return Batch(dense, sparse, words[0].view(torch.float32))


_DONE = object()


class _Pipeline:
    """The producer thread: fills slot j % 2 with window j, copies it to the device, queues it."""

    def __init__(self, loader: StreamLoader, plan: EpochPlan, windows: range):
        self.loader, self.plan, self.windows = loader, plan, windows
        device = loader.device
        self.slots = [_Slot(len(loader.own_lanes), plan.window, plan.lane_batch, device) for _ in range(2)]
        self.free = threading.Semaphore(2)
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.carry: dict[int, dict[str, np.ndarray]] = {}  # row groups that go on into the next window
        self.pool = ThreadPoolExecutor(loader.threads, thread_name_prefix="ctrflow-decode")
        self.thread = threading.Thread(target=self._produce, name="ctrflow-stream", daemon=True)
        self.thread.start()

    def __iter__(self):
        while True:
            item = self.ready.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            window, slot = item
            if slot.copied is not None:  # sync point (device side only): the batches wait for the copy
                torch.cuda.current_stream(self.loader.device).wait_event(slot.copied)
            yield window, slot

    def release(self, slot: _Slot) -> None:
        """The consumer is done with `slot`: its device buffer may be overwritten after the queued gathers."""
        if slot.freed is not None:
            slot.freed.record(torch.cuda.current_stream(self.loader.device))
        self.free.release()

    def close(self) -> None:
        """Stop the producer (also mid-epoch) and wait for it."""
        self.stop.set()
        self.free.release()
        self.thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.stream is not None:  # copies of windows never consumed must end before their buffers are reused
            self.stream.synchronize()

    def _produce(self) -> None:
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.loader.device)  # a new thread starts on device 0
            for window in self.windows:
                while not self.free.acquire(timeout=0.05):
                    if self.stop.is_set():
                        return
                if self.stop.is_set():
                    return
                slot = self.slots[window % 2]
                if slot.copied is not None:
                    slot.copied.synchronize()  # the last copy out of this host buffer has finished
                self._fill(window, slot)
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(slot.freed)  # the consumer's gathers of this slot are done
                        slot.data.copy_(slot.host, non_blocking=True)
                        slot.index.copy_(slot.host_index, non_blocking=True)
                        slot.copied.record(self.stream)
                self.ready.put((window, slot))
            self.ready.put(_DONE)
        except BaseException as err:  # handed to the consumer, which re-raises it
            self.ready.put(err)

    def _fill(self, window: int, slot: _Slot) -> None:
        """Decode the window's row groups into `slot.host` and its permuted indices into `slot.host_index`."""
        plan, lanes = self.plan, self.loader.own_lanes
        words = slot.host.numpy()
        jobs = [(pos, task) for pos, lane in enumerate(lanes) for task in plan.tasks(window, lane)]
        pieces = list(self.pool.map(lambda job: self._copy_piece(words, *job), jobs))
        index = slot.host_index.numpy().reshape(-1, len(lanes), plan.lane_batch)  # [batches, lanes, b]

        def permute(pos: int) -> None:
            order = plan.permutation(window, lanes[pos])
            index[:len(order) // plan.lane_batch, pos] = order.reshape(-1, plan.lane_batch) + pos * plan.window

        list(self.pool.map(permute, range(len(lanes))))
        rows = self.plan.index.piece_rows
        self.carry = {piece: columns for (piece, _, hi, _), columns in zip((t for _, t in jobs), pieces)
                      if hi < rows[piece]}

    def _copy_piece(self, words: np.ndarray, pos: int, task: tuple[int, int, int, int]) -> dict[str, np.ndarray]:
        """Copy rows [lo, hi) of one row group to lane `pos`'s window at `at` (a pool thread)."""
        piece, lo, hi, at = task
        columns = self.carry.get(piece) or self.plan.index.read(piece)
        start = pos * self.plan.window + at
        floats = words.view(np.float32)
        for k, name in enumerate(COLUMNS):
            values = columns[name][lo:hi]
            if k >= FIRST_ID_COLUMN:
                self._check_ids(values, k - FIRST_ID_COLUMN, piece, lo)
                np.copyto(words[k, start:start + hi - lo], values, casting="unsafe")
            else:
                np.copyto(floats[k, start:start + hi - lo], values, casting="unsafe")
        return columns

    def _check_ids(self, ids: np.ndarray, feature: int, piece: int, lo: int) -> None:
        """`UserError` naming file, row and feature of the first id outside [0, table size)."""
        sizes = self.loader.sizes
        if sizes is None or not len(ids):
            return
        unsigned = ids.view(np.dtype(f"u{ids.dtype.itemsize}")) if ids.dtype.kind == "i" else ids
        if unsigned.max() < sizes[feature]:  # negatives are huge as unsigned: one pass for both bounds
            return
        row = int(np.argmax((ids < 0) | (ids >= sizes[feature])))
        index = self.plan.index
        file = index.files[index.piece_file[piece]]
        raise UserError(
            f"{file}: row {int(index.piece_first_row[piece]) + lo + row}: {SPARSE[feature]} id {int(ids[row])} is "
            f"outside its embedding table of {int(sizes[feature])} rows (ids must be in [0, {int(sizes[feature])}); "
            f"does the data match schema.json?)")
