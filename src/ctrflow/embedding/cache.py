"""One table (or shard) in host memory with a device cache of the rows batches use.

The rows and each optimizer state tensor live in host memory (`store`, `host_state`: pinned when the
device is a GPU). A batch's distinct rows are brought into a device cache of `C` slots before its
lookups (`prefetch`): `weight` [C, D] is the parameter the lookups read (ids translated to slots) and
the sparse optimizers update in place, with their state in `state` ([C] or [C, D] per key). Policy:
LRU over batches. A slot's last use is the number of the batch that last looked it up; a miss takes
the least recently used slots, never one of the current or the previous batch (whose step may still
be running when the next batch is prefetched beside it), and writes their rows back to the host
first, with their optimizer state, where a training batch looked them up (dirty). The arithmetic on a
row is the same wherever it lives, so a cached table trains bitwise like one kept on the device.

Prefetch and lookup are two calls so that the next batch's rows can move while the current step
runs: `prefetch(ids)` queues the batch's slots; the forward's `slots(ids)` takes them in order (or
prefetches in line when none is queued). On CUDA a prefetch runs on a side stream, after the work
queued before it (the ids, and the steps whose rows it may evict), and the lookup waits for it; its
device-to-host reads (miss counts, evicted rows) still hold the calling thread, so the step's later
work is queued only after them. On the CPU it runs in line.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from ctrflow.errors import UserError

NEVER = -1  # `used` of a slot holding no row
KEPT = torch.iinfo(torch.int64).max  # `used` as victim key: the current and previous batch's slots


def take_queued(queued: deque, ids: torch.Tensor) -> torch.Tensor:
    """The oldest queued prefetch (ids shape, what it placed, ready event or None), for a lookup of
    `ids`: checked against their shape, and waited for on the current stream."""
    shape, placed, ready = queued.popleft()
    if shape != ids.shape:
        raise RuntimeError(f"host cache: looked up ids of shape {list(ids.shape)}, but the next prefetched "
                           f"batch had {list(shape)} (prefetch each batch once, in the order of the lookups)")
    if ready is not None:
        main = torch.cuda.current_stream(placed.device)
        main.wait_event(ready)
        placed.record_stream(main)
    return placed


class HostCache:
    """Rows [rows, dim] in host memory, `cache_rows` of them in a device cache (the module doc).

    `fill(store)` writes the initial rows into the host store (drawn there: a table that does not fit
    the device is never whole anywhere but in host memory).
    """

    def __init__(self, rows: int, dim: int, cache_rows: int, device: torch.device | str,
                 fill: Callable[[torch.Tensor], None]):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.store = torch.empty(rows, dim, pin_memory=self.pinned)
        fill(self.store)
        self.weight = nn.Parameter(torch.zeros(cache_rows, dim, device=self.device))
        self.slot_of = torch.full((rows,), -1, dtype=torch.int32, device=self.device)  # row -> slot
        self.id_of = torch.full((cache_rows,), -1, dtype=torch.int64, device=self.device)  # slot -> row
        self.used = torch.full((cache_rows,), NEVER, dtype=torch.int64, device=self.device)
        self.dirty = torch.zeros(cache_rows, dtype=torch.bool, device=self.device)
        self.host_state: dict[str, torch.Tensor] = {}
        self.state: dict[str, torch.Tensor] = {}
        self.batches = 0
        self.queued: deque = deque()  # (ids shape, slots, ready event or None), in prefetch order
        self.rows_looked_up = self.rows_hit = 0  # distinct rows per batch, and those already cached
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def cache_rows(self) -> int:
        """Slots in the device cache."""
        return self.weight.shape[0]

    def bind_state(self, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The optimizer state `keys` ("sum" per row, others per element), zero in host memory and in
        the cache; returns the cache's dict, which the sparse optimizer updates in place."""
        rows, dim = self.store.shape
        for key in keys:
            if key not in self.state:
                shape = (rows,) if key == "sum" else (rows, dim)
                self.host_state[key] = torch.zeros(shape, pin_memory=self.pinned)
                self.state[key] = torch.zeros((self.cache_rows, *shape[1:]), device=self.device)
        return self.state

    @torch.no_grad()
    def prefetch(self, ids: torch.Tensor, train: bool = True) -> None:
        """Bring the rows of `ids` (any shape) into the cache and queue their slots for `slots`.
        `train`: the batch's step will update its rows (they are written back when evicted)."""
        if self.stream is None:
            self._queue_in_line(ids, train)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the ids, the rows' last updates
        with torch.cuda.stream(self.stream):
            slots = self._place(ids.reshape(-1), train).view(ids.shape)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.queued.append((ids.shape, slots, ready))

    def slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The cache slots of `ids`, as the oldest queued prefetch placed them (prefetched in line,
        under the caller's grad mode, when none is queued)."""
        if not self.queued:
            self._queue_in_line(ids, torch.is_grad_enabled())
        return take_queued(self.queued, ids)

    @torch.no_grad()
    def _queue_in_line(self, ids: torch.Tensor, train: bool) -> None:
        """Prefetch on the current stream (after the side stream's queued work)."""
        self._settle()
        self.queued.append((ids.shape, self._place(ids.reshape(-1), train).view(ids.shape), None))

    def _place(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        """Cache every row of flat `ids`, returning their slots."""
        self.batches += 1
        rows = torch.unique(ids)
        slots = self.slot_of[rows].long()
        miss = slots < 0
        self.used[slots[~miss]] = self.batches  # hits are kept before victims are chosen
        missing = rows[miss]
        n = int(missing.numel())  # a device-to-host sync: the transfer sizes
        self.rows_looked_up += int(rows.numel())
        self.rows_hit += int(rows.numel()) - n
        if n:
            free = self._victims(n, int(rows.numel()))
            self._evict(free)
            self._load(free, missing)
            slots[miss] = free
            self.used[free] = self.batches
        if train:
            self.dirty[slots] = True
        return self.slot_of[ids].long()

    def _victims(self, n: int, batch_rows: int) -> torch.Tensor:
        """The `n` least recently used slots outside the current and the previous batch."""
        key = torch.where(self.used >= self.batches - 1, KEPT, self.used)
        victims = torch.topk(key, min(n, self.cache_rows), largest=False, sorted=False).indices
        if n > self.cache_rows or bool((key[victims] == KEPT).any()):
            raise UserError(f"host cache of {self.cache_rows:,} rows cannot hold a batch's {batch_rows:,} distinct "
                            f"rows beside the previous batch's; raise --embedding-memory-gib or lower the batch size")
        return victims

    def _evict(self, slots: torch.Tensor) -> None:
        """Write the dirty rows of `slots` back to the host and free the slots."""
        self._write_back(slots[self.dirty[slots]])
        old = self.id_of[slots]
        self.slot_of[old[old >= 0]] = -1
        self.id_of[slots] = -1

    def _write_back(self, slots: torch.Tensor) -> None:
        """Copy the rows in `slots` (holding rows) and their state to the host; they are clean after."""
        if not slots.numel():
            return
        rows = self.id_of[slots].cpu()
        self.store[rows] = self.weight.detach()[slots].cpu()
        for key, values in self.state.items():
            self.host_state[key][rows] = values[slots].cpu()
        self.dirty[slots] = False

    def _load(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy host `rows` and their state into `slots`."""
        host_rows = rows.cpu()
        self.weight.detach()[slots] = self.store[host_rows].to(self.device, non_blocking=True)
        for key, values in self.state.items():
            values[slots] = self.host_state[key][host_rows].to(self.device, non_blocking=True)
        self.slot_of[rows] = slots.to(torch.int32)
        self.id_of[slots] = rows

    @torch.no_grad()
    def flush(self) -> None:
        """Write every dirty cached row back to the host (the rows stay cached)."""
        self._settle()
        self._write_back(self.dirty.nonzero().squeeze(1))

    def _settle(self) -> None:
        """CUDA: the current stream waits for the prefetches queued on the side stream (they change the
        bookkeeping and the cache rows that in-line work reads)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def whole(self) -> torch.Tensor:
        """All rows, current (the host store after a flush; not a copy)."""
        self.flush()
        return self.store

    def whole_state(self, key: str) -> torch.Tensor:
        """One optimizer state tensor of all rows, current (host memory, not a copy)."""
        self.flush()
        return self.host_state[key]

    @torch.no_grad()
    def load(self, rows: torch.Tensor) -> None:
        """Take all rows (e.g. from a checkpoint); the cache starts empty."""
        self._empty()
        self.store.copy_(rows)

    @torch.no_grad()
    def load_state(self, key: str, values: torch.Tensor) -> None:
        """Take one optimizer state tensor of all rows; the cache starts empty."""
        self._empty()
        self.host_state[key].copy_(values)

    def _empty(self) -> None:
        """Write the dirty rows back and drop every cached row (queued prefetches included)."""
        self.flush()
        self.slot_of.fill_(-1)
        self.id_of.fill_(-1)
        self.used.fill_(NEVER)
        self.queued.clear()
