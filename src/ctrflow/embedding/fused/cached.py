"""The host tables of one fused collection: their caches, and the batches prefetched ahead of their lookups.

`CachedTables` turns ids [B, S] into the ids the kernels read: each host table's columns become its
slot numbers (`ctrflow.embedding.fused.cache.SlotCache.place`), the other columns stay as they are.
`prefetch(ids)` does this for a batch ahead of its lookup and queues the result; the lookup takes the
queued batches in order, or places its batch in line when none is queued. On CUDA a prefetch runs on
a side stream after the work queued before it (the ids, the steps whose rows it may evict), so the
next batch's rows move while the current step runs, and the lookup waits for it. A prefetch never
evicts the rows of the batch before it, so at most one batch may be queued ahead of the next lookup
(`ctrflow train` prefetches the next batch just before each step). A lookup without gradients (an
evaluation between steps) drops the queued batches, whose rows stay cached, and places in line.

On CUDA a training batch's placement is captured as a CUDA graph the second time its shape comes (the
first compiles its kernels) and replayed from then on: it reads nothing back to the host, so its
hundreds of small operations need not be launched one by one.
"""

from __future__ import annotations

from collections import deque

import torch

from ctrflow.embedding.cache import take_queued
from ctrflow.embedding.fused.cache import SlotCache


class CachedTables:
    """`caches` by table name and each table's id columns [a, b) of ids [B, S] (the module doc)."""

    def __init__(self, caches: dict[str, SlotCache], columns: dict[str, tuple[int, int]], device: torch.device):
        self.caches, self.columns = caches, columns
        self.queued: deque = deque()  # (ids shape, ids for the kernels, ready event or None)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # (ids shape, the parts' addresses) -> None once placed eagerly, then (CUDA graph, its ids, its
        # output): a training batch's placement is some 100 small operations a host table, replayed as one
        self.graphs: dict = {}

    def prefetch(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool = True) -> None:
        """Place batch `ids` [B, S] now (its step comes later) and queue it for `lookup_ids`."""
        if len(self.queued) >= 2:
            raise RuntimeError("host tables: prefetch at most one batch ahead of the next lookup")
        if self.stream is None:
            self.queued.append((ids.shape, self._translate(ids, parts, train), None))
            return
        self.stream.wait_stream(torch.cuda.current_stream(ids.device))  # the ids, the rows' last updates
        ids.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = self._translate(ids, parts, train)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.queued.append((ids.shape, out, ready))

    def lookup_ids(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> torch.Tensor:
        """`ids` [B, S] with the host tables' columns as buffer slots: the oldest queued batch (an
        evaluation's, `train` False, drops the queue), or this one placed in line."""
        if not train and self.queued:
            self.drop()
        if not self.queued:
            self.settle()
            return self._translate(ids, parts, train)
        return take_queued(self.queued, ids)

    def _translate(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> torch.Tensor:
        """`ids` with the host tables' columns as slots, every row placed (the module doc)."""
        for name, cache in self.caches.items():
            a, b = self.columns[name]
            cache.reserve(ids.shape[0] * (b - a))
        if not (ids.is_cuda and train):  # evaluation's batches place eagerly: rare, and large to capture
            return self._place(ids, parts, train)
        key = (tuple(ids.shape), tuple(p.data_ptr() for p in parts))
        if key not in self.graphs:  # the first batch of a shape runs eagerly: it compiles the kernels
            self.graphs[key] = None
            return self._place(ids, parts, train)
        if self.graphs[key] is None:
            static, graph = ids.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a loader thread may copy meanwhile
                out = self._place(static, parts, train)
            self.graphs[key] = (graph, static, out)
        graph, static, out = self.graphs[key]
        static.copy_(ids)
        graph.replay()
        return out.clone()  # the next replay rewrites `out` while this batch's step may still read it

    def _place(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> torch.Tensor:
        out = ids.clone()
        for name, cache in self.caches.items():
            a, b = self.columns[name]
            out[:, a:b] = cache.place_tensors(ids[:, a:b].reshape(-1), parts, train).view(ids.shape[0], b - a)
        return out

    def drop(self) -> None:
        """Forget the queued batches (their rows stay cached, correct either way)."""
        self.settle()
        self.queued.clear()

    def settle(self) -> None:
        """CUDA: the current stream waits for the prefetches on the side stream (they change the
        bookkeeping and the cache rows that in-line work reads)."""
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
