"""The host tables of one fused collection: their caches, and the batches prefetched ahead of their lookups.

`CachedTables` turns ids [B, S] into the ids the kernels read: each host table's columns become its
slot numbers (`ctrflow.embedding.fused.cache.SlotCache.place`), the other columns stay as they are.
`prefetch(ids)` does this for a batch ahead of its lookup and queues the result; the lookup takes the
queued batches in order, or places its batch in line when none is queued. On CUDA a prefetch runs in a
thread of its own on a side stream, after the work queued before it (the ids, the steps whose rows it
may evict): the bookkeeping, then the rows' moves (`SlotCache.move`), whose sizes it must read back:
the GPU writes the evicted rows into host memory while the CPU gathers the rows arriving, which keeps
that thread busy while the current step runs. The lookup waits until the batch's rows are in. The next
batch's moves follow on the same stream, so its gathers read host memory after these writes. A
prefetch never evicts the rows of the batch before it, so at most one batch may be queued ahead of the
next lookup (`ctrflow train` prefetches the next batch just before
each step). A lookup without gradients (an evaluation between steps) drops the queued batches, whose
rows stay cached, and places in line.

On CUDA a training batch's bookkeeping is captured as a CUDA graph the second time its shape comes (the
first compiles its kernels) and replayed from then on: it reads nothing back to the host, so its
hundreds of small operations need not be launched one by one.

The training step itself may be a CUDA graph too (`ctrflow.accel.graphs.GraphedStep`): `stage(ids)`
takes the batch's lookup out of it (waiting for its prefetch is host work) and copies the slots into
`staged`, the tensor that a lookup captured in the graph reads.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ctrflow.embedding.cache import take_queued
from ctrflow.embedding.fused.cache import SlotCache
from ctrflow.processes import available_cores


# cores left out of torch's CPU threads while host tables move beside the step: the step's thread,
# autograd's, and the mover's waits on the GPU (CUDA's waits spin on a core), and one more, as measured
# (`move_threads`). The gathers split their rows over torch's threads in equal shares, so one thread
# sharing its core holds up all of them
SPARE_CORES = 4


def move_threads() -> int:
    """torch's CPU threads for a process whose fused host tables move beside the step: SPARE_CORES
    fewer than the cores it may run on, at most torch's own choice (so calling it again changes
    nothing). On one H200 with 16 cores, when the CPU still scattered the rows leaving, the DLRMv2
    shape's cached step (0.2 GB of random rows each way a step) took 39.5-41.3 ms in five runs with 12
    threads and 44.3 with 16 on one machine, and 45.3 against 66.0 ms eager on another
    (benchmarks/NOTES.md, "Tables in host memory")."""
    return max(1, min(torch.get_num_threads(), available_cores() - SPARE_CORES))


class CachedTables:
    """`caches` by table name and each table's id columns [a, b) of ids [B, S] (the module doc)."""

    def __init__(self, caches: dict[str, SlotCache], columns: dict[str, tuple[int, int]], device: torch.device):
        self.caches, self.columns = caches, columns
        self.queued: deque = deque()  # (ids shape, Future of (ids for the kernels, ready event or None))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # one thread for the batches' bookkeeping and moves, in batch order
        self.mover = ThreadPoolExecutor(1, thread_name_prefix="ctrflow-host-tables") if self.stream else None
        self.moving: Future | None = None  # the last prefetch, done when its rows are in
        # (ids shape, the parts' addresses) -> None once placed eagerly, then (CUDA graph, its ids, its
        # output): a training batch's bookkeeping is some 100 small operations a host table, replayed as one
        self.graphs: dict = {}
        self.staged: torch.Tensor | None = None  # the ids a captured step's lookup reads (`stage`)

    def prefetch(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool = True) -> None:
        """Place batch `ids` [B, S] now (its step comes later) and queue it for `lookup_ids`."""
        if len(self.queued) >= 2:
            raise RuntimeError("host tables: prefetch at most one batch ahead of the next lookup")
        self._reserve(ids)
        placed: Future = Future()
        if self.stream is None:
            placed.set_result((self._place(ids, parts, train), None))
        else:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(ids.device))  # the ids, the rows' last updates
            ids.record_stream(self.stream)
            booked: Future = Future()
            self.moving = self.mover.submit(self._prefetch, ids, parts, train, after, placed, booked)
            # the current stream's next work (the step before this batch's) waits for this batch's
            # bookkeeping: beside the step its small kernels wait for SMs (benchmarks/NOTES.md)
            event = booked.result()
            if event is not None:
                torch.cuda.current_stream(ids.device).wait_event(event)
        self.queued.append((ids.shape, placed))

    def _prefetch(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool, after: torch.cuda.Event,
                  placed: Future, booked: Future) -> None:
        """The mover thread's part of `prefetch`: the batch's bookkeeping and moves; `placed` gets the
        batch's ids for the kernels and the event its rows are in by."""
        try:
            with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
                self.stream.wait_event(after)
                out = self._place(ids, parts, train, booked)
                ready = torch.cuda.Event()
                ready.record(self.stream)
        except BaseException as error:
            if not booked.done():
                booked.set_result(None)
            placed.set_exception(error)
            raise
        placed.set_result((out, ready))

    def lookup_ids(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> torch.Tensor:
        """`ids` [B, S] with the host tables' columns as buffer slots: the oldest queued batch (an
        evaluation's, `train` False, drops the queue), or this one placed in line."""
        if not train and self.queued:
            self.drop()
        if not self.queued:
            self.settle()
            self._reserve(ids)
            return self._place(ids, parts, train)
        shape, placed = self.queued[0]
        self.queued[0] = (shape, *placed.result())
        return take_queued(self.queued, ids)

    def stage(self, ids: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """`lookup_ids` of training batch `ids` into `staged`, for a CUDA graph of the step to read: one
        tensor, made by the first call, that every later call overwrites (the same shape: a graph's)."""
        out = self.lookup_ids(ids, parts, True)
        if self.staged is None:
            self.staged = out
        else:
            self.staged.copy_(out)

    def _reserve(self, ids: torch.Tensor) -> None:
        for name, cache in self.caches.items():
            a, b = self.columns[name]
            cache.reserve(ids.shape[0] * (b - a))

    def _place(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool, booked: Future | None = None
               ) -> torch.Tensor:
        """`ids` with the host tables' columns as slots, every row placed and moved in line; `booked` (a
        prefetch) gets the event of the bookkeeping's end on the prefetch stream, before the moves."""
        out, moves = self._translate(ids, parts, train)
        if booked is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            booked.set_result(done)
        for cache, m in zip(self.caches.values(), moves):
            cache.move(m, parts)
        return out

    def _translate(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> tuple[torch.Tensor, list]:
        """(`ids` with the host tables' columns as slots, each host table's `Moves`): the bookkeeping."""
        if not (ids.is_cuda and train):  # evaluation's batches place eagerly: rare, and large to capture
            return self._book(ids, parts, train)
        key = (tuple(ids.shape), tuple(p.data_ptr() for p in parts))
        if key not in self.graphs:  # the first batch of a shape runs eagerly: it compiles the kernels
            self.graphs[key] = None
            return self._book(ids, parts, train)
        if self.graphs[key] is None:
            static, graph = ids.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the step's thread queues meanwhile
                out, moves = self._book(static, parts, train)
            self.graphs[key] = (graph, static, out, moves)
        graph, static, out, moves = self.graphs[key]
        static.copy_(ids)
        graph.replay()
        return out.clone(), moves  # the next replay rewrites `out` while this batch's step may still read it

    def _book(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> tuple[torch.Tensor, list]:
        out, moves = ids.clone(), []
        for name, cache in self.caches.items():
            a, b = self.columns[name]
            slots, m = cache.place_tensors(ids[:, a:b].reshape(-1), parts, train)
            out[:, a:b] = slots.view(ids.shape[0], b - a)
            moves.append(m)
        return out, moves

    def drop(self) -> None:
        """Forget the queued batches (their rows stay cached, correct either way)."""
        self.settle()
        self.queued.clear()

    def settle(self) -> None:
        """CUDA: wait until the prefetches are done, and make the current stream wait for their work on
        the side stream (they change the bookkeeping, the cache rows and the host rows that in-line work
        reads)."""
        if self.moving is not None:
            self.moving.result()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def flush(self, parts: list[torch.Tensor]) -> None:
        """Write every dirty cached row back to host memory."""
        self.settle()
        for cache in self.caches.values():
            cache.flush(parts)

    def hit_rate(self) -> float | None:
        """Share of the distinct rows looked up per batch that were already cached (None: none yet)."""
        looked_up, hits = (int(x) for x in sum(c.stats for c in self.caches.values())[:2].tolist())
        return hits / looked_up if looked_up else None

    def bytes_moved(self) -> tuple[int, int]:
        """(bytes read into the caches, bytes written back to host memory) so far, rows with their state."""
        read = written = 0
        for cache in self.caches.values():
            _, _, rows_in, rows_out = (int(x) for x in cache.stats.tolist())
            row_bytes = sum(h[0].numel() * h.element_size() for h in cache.host)
            read, written = read + rows_in * row_bytes, written + rows_out * row_bytes
        return read, written
