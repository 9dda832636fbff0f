"""Windows of Parquet rows moved to the device: decode threads, page-locked buffers, double buffering.

Shared by the shuffled training stream (`ctrflow.loaders.stream`) and the in-order evaluation scan
(`ctrflow.loaders.scan`); a *plan* (`ctrflow.loaders.stream_plan`) says which rows fill which window.
Per window (every lane of this process, `plan.window` rows each):

1. a pool of threads decodes the window's row groups (pyarrow releases the GIL) and copies each
   column, contiguous, into a page-locked host buffer [words, lanes * window] of 32-bit words (the
   row layout of `ctrflow.loaders.layout`: label, dense, then every sparse slot; 40 words for
   Criteo; ids checked on the way); a shuffled plan's permuted batch indices are drawn there too;
2. one asynchronous host-to-device copy of that buffer (and of the index) on a side stream;
3. the consumer cuts batches out of the device buffer: no per-row work on the host.

Two windows are in flight: one consumed on the device while the threads fill the next. A pipeline
may fill one more window of another plan after its own (`lookahead`: the next epoch's first) and
hand its buffers to the next pipeline, so an epoch starts without waiting and without allocating.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Sequence

import numpy as np
import torch

from ctrflow.loaders.batch import Batch
from ctrflow.loaders.layout import RowLayout, bad_id_message, first_bad_ids
from ctrflow.errors import UserError


class Source(Protocol):
    """What a pipeline needs of its loader."""

    own_lanes: list[int]
    device: torch.device
    threads: int
    sizes: np.ndarray | None  # table sizes, one per sparse feature (None: only the int32 range is checked)


class Slot:
    """One window's buffers: host [words, lanes * window] int32 words (+ batch index when `indexed`),
    and their device copies (`layout`: which words are what)."""

    def __init__(self, layout: RowLayout, lanes: int, window: int, lane_batch: int, device: torch.device,
                 indexed: bool = True):
        pinned = device.type == "cuda"
        self.first_id = layout.first_id
        shape, index_shape = (layout.words, lanes * window), (window // lane_batch, lanes * lane_batch)
        self.host = torch.empty(shape, dtype=torch.int32, pin_memory=pinned)
        self.host_index = torch.empty(index_shape, dtype=torch.int32, pin_memory=pinned) if indexed else None
        self.data, self.index = self.host, self.host_index
        self.copied = self.freed = None
        self.rows = 0  # rows of the window now held (the last window may be short)
        if pinned:
            self.data = torch.empty(shape, dtype=torch.int32, device=device)
            self.index = torch.empty(index_shape, dtype=torch.int32, device=device) if indexed else None
            self.copied, self.freed = torch.cuda.Event(), torch.cuda.Event()

    def batch(self, k: int) -> Batch:
        """The window's k-th batch by its permuted index: one gather of the [words, n] words."""
        return _split(self.data.index_select(1, self.index[k]), self.first_id)  # [words, rows of this process]

    def span(self, lo: int, hi: int) -> Batch:
        """Rows [lo, hi) of the window, in order (copied out: the slot is refilled after `release`)."""
        batch = _split(self.data[:, lo:hi], self.first_id)
        return Batch(batch.dense, batch.sparse, batch.labels.clone())


def _split(words: torch.Tensor, first_id: int) -> Batch:
    """[words, n] -> Batch(dense [n, num_dense] f32, ids [n, slots] int64, labels [n] f32): words
    [1, first_id) are the dense values, [first_id, words) the sparse slots."""
    dense = words[1:first_id].view(torch.float32).t().contiguous()
    sparse = words[first_id:].t().to(torch.int64, memory_format=torch.contiguous_format)
    return Batch(dense, sparse, words[0].view(torch.float32))


_DONE = object()


class WindowPipeline:
    """The producer thread: fills slot j % 2 with window j of `plan`, copies it to the device, queues it.

    Iterate for `(window, slot)`; call `release(slot)` when its batches are queued. `handover`
    gives (slots, first, carry) for a next pipeline after a `lookahead` fill."""

    def __init__(self, source: Source, plan, windows: range, *, slots: list[Slot] | None = None,
                 first: tuple[int, Slot] | None = None, carry: dict | None = None, lookahead=None):
        self.source, self.plan, self.windows, self.lookahead = source, plan, windows, lookahead
        device = source.device
        self.slots = slots or [Slot(plan.index.layout, len(source.own_lanes), plan.window, plan.lane_batch, device,
                                    plan.indexed) for _ in range(2)]
        self.free = threading.Semaphore(2 - (first is not None))
        self.ready: queue.Queue = queue.Queue()
        if first is not None:
            self.ready.put(first)
        self.stop = threading.Event()
        self.prefetched: Slot | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.carry: dict[int, dict[str, np.ndarray]] = carry or {}  # row groups that go on into the next window
        self.pool = ThreadPoolExecutor(source.threads, thread_name_prefix="ctrflow-decode")
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
                torch.cuda.current_stream(self.source.device).wait_event(slot.copied)
            yield window, slot

    def release(self, slot: Slot) -> None:
        """The consumer is done with `slot`: its device buffer may be overwritten after the queued reads."""
        if slot.freed is not None:
            slot.freed.record(torch.cuda.current_stream(self.source.device))
        self.free.release()

    def close(self, sync: bool = True) -> None:
        """Stop the producer (also mid-epoch) and wait for it."""
        self.stop.set()
        self.free.release()
        self.thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if sync and self.stream is not None:  # copies never consumed must end before their buffers are reused
            self.stream.synchronize()

    def handover(self) -> tuple[list[Slot], tuple[int, Slot] | None, dict]:
        """After the last window was consumed: (slots, the lookahead's (0, slot) or None, carry); closes."""
        self.thread.join()  # the lookahead fill, if any, ends first
        self.close(sync=False)  # the slots' events order their next uses
        first = self.prefetched
        if first is None:
            return self.slots, None, {}
        other = self.slots[1] if first is self.slots[0] else self.slots[0]
        return [first, other], (0, first), self.carry

    def _produce(self) -> None:
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.source.device)  # a new thread starts on device 0
            for window in self.windows:
                if not self._put(self.plan, window, self.slots[window % 2]):
                    return
            self.ready.put(_DONE)
            if self.lookahead is not None:  # the next epoch's first window, into the slot freed next
                slot = self.slots[self.windows.stop % 2]
                if self._fill_slot(self.lookahead, 0, slot):
                    self.prefetched = slot
        except BaseException as err:  # handed to the consumer, which re-raises it
            self.ready.put(err)

    def _put(self, plan, window: int, slot: Slot) -> bool:
        filled = self._fill_slot(plan, window, slot)
        if filled:
            self.ready.put((window, slot))
        return filled

    def _fill_slot(self, plan, window: int, slot: Slot) -> bool:
        """Wait for `slot` to be free, fill it and start its copy; False when stopped."""
        while not self.free.acquire(timeout=0.05):
            if self.stop.is_set():
                return False
        if self.stop.is_set():
            return False
        if slot.copied is not None:
            slot.copied.synchronize()  # the last copy out of this host buffer has finished
        self._fill(plan, window, slot)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(slot.freed)  # the consumer's reads of this slot are done
                slot.data.copy_(slot.host, non_blocking=True)
                if slot.index is not None:
                    slot.index.copy_(slot.host_index, non_blocking=True)
                slot.copied.record(self.stream)
        return True

    def _fill(self, plan, window: int, slot: Slot) -> None:
        """Decode the window's row groups into `slot.host` and, if indexed, its permuted indices."""
        lanes = self.source.own_lanes
        words = slot.host.numpy()
        jobs = [(pos, task) for pos, lane in enumerate(lanes) for task in plan.tasks(window, lane)]
        pieces = list(self.pool.map(lambda job: self._copy_piece(plan, words, *job), jobs))
        slot.rows = plan.window_size(window)
        if slot.host_index is not None:
            index = slot.host_index.numpy().reshape(-1, len(lanes), plan.lane_batch)  # [batches, lanes, b]

            def permute(pos: int) -> None:
                order = plan.permutation(window, lanes[pos])
                index[:len(order) // plan.lane_batch, pos] = order.reshape(-1, plan.lane_batch) + pos * plan.window

            list(self.pool.map(permute, range(len(lanes))))
        rows = plan.index.piece_rows
        self.carry = {piece: columns for (piece, _, hi, _), columns in zip((t for _, t in jobs), pieces)
                      if hi < rows[piece]}

    def _copy_piece(self, plan, words: np.ndarray, pos: int, task: tuple[int, int, int, int]) -> dict:
        """Copy rows [lo, hi) of one row group to lane `pos`'s window at `at` (a pool thread)."""
        piece, lo, hi, at = task
        columns = self.carry.get(piece) or plan.index.read(piece)
        start = pos * plan.window + at
        floats = words.view(np.float32)
        for c in plan.index.layout.columns:
            values = columns[c.name][lo:hi]
            if c.is_ids:
                check_window_ids(values, c.feature, self.source.sizes, plan.index, piece, lo)
                if c.width == 1:
                    np.copyto(words[c.first, start:start + hi - lo], values, casting="unsafe")
                else:  # multi-hot [n, width] -> its `width` words of the n rows
                    np.copyto(words[c.first:c.first + c.width, start:start + hi - lo], values.T, casting="unsafe")
            else:
                np.copyto(floats[c.first, start:start + hi - lo], values, casting="unsafe")
        return columns


def check_window_ids(ids: np.ndarray, feature: int, sizes: Sequence[int] | None, index, piece: int, lo: int) -> None:
    """`UserError` naming file, row and feature of the first id outside [0, table size), or, without
    sizes, outside the int32 range the buffers hold (it would be silently truncated). `ids` are
    rows [lo, ...) of `piece`'s column of sparse feature `feature`: [n], or [n, max_length]."""
    limit = None if sizes is None else int(sizes[feature])
    row = first_bad_ids(ids, limit)
    if row is None:
        return
    file = index.files[index.piece_file[piece]]
    raise UserError(bad_id_message(str(file), int(index.piece_first_row[piece]) + lo + row,
                                   index.layout.sparse_names[feature], ids[row], limit))
