"""One host table of the fused collection: its rows in host memory, a cache of slots in the one buffer.

`FusedEmbeddingCollection` keeps a table the plan places in host memory as `cache_rows` rows of its
one buffer (the slots), their optimizer state in `row_state`, and the whole table, weights and state,
in host memory (`host`; pinned when the buffer is on a GPU). A batch's ids of the table become slot
numbers (`place`), and the usual gather, bag and update kernels run on them unchanged. The bookkeeping
lives beside the buffer, and placing a batch reads nothing back to the host: `reserve` does the host's
part (the batch's size against the cache), `place_tensors` the rest, which a CUDA graph can hold
(`ctrflow.embedding.fused.cached` replays it):

- `slot_of` [rows] int32 (-1: not cached), `id_of` [C] int64 (-1: empty), `used` [C] int64 (the
  number of the last batch that looked the slot up, counted by `clock` on the device), `dirty` [C]
  bool; each with one spare entry at its end, where the writes of masked-out lanes land, so that no
  tensor's size depends on the ids.
- Misses: the first occurrence of each row not cached claims the row in `slot_of` (the least code
  wins), then the claimed rows are packed first; their count stays on the device.
- Victims: LRU over batches, in `AGES` buckets of age (slots idle for `AGES - 1` batches or more, or
  never used, share the oldest). The oldest buckets are taken whole, the last one in slot order,
  until the misses are covered. A slot of this batch or of the previous one is never taken (that
  step may still be running beside a prefetch), so a cache that holds two batches' ids always has
  room; a smaller one is refused before the batch is placed (the batch's size is known on the host).
- Moves: victims holding rows a training batch looked up (dirty) are written back to host memory
  with their state, then the missing rows and their state are read in: on a GPU by
  `kernels.copy_rows_kernel`, which reads and writes pinned host memory directly and reads the row
  count on the device; elsewhere by torch indexing.
- `stats` counts the distinct rows looked up and found cached, and the rows read in and written back.
- A multi-hot table's padding row 0 stays in slot 0 (the kernels skip id 0 of a bag).
"""

from __future__ import annotations

import weakref

import torch

from ctrflow.embedding.fused import ops
from ctrflow.errors import UserError

NEVER = -1  # `used` of an empty slot (the oldest age)
PINNED = 2**62  # `used` of the padding slot: never a victim
AGES = 64  # age buckets: few enough for torch.histc to count them in shared memory
COPY_ROWS = 32  # rows a program of `copy_rows_kernel` moves at a time
# its programs an SM, each looping over blocks: a grid covering every row launched tens of thousands of
# programs, most finding no row, and moved rows no faster (benchmarks/NOTES.md, "Tables in host memory")
COPY_PROGRAMS = 2
REGISTER_BYTES = 1 << 26  # host tensors this large are pinned in place (cudaHostRegister), not copied


class SlotCache:
    """Table rows [rows, ...] in host memory, `cache_rows` of them in slots `start`.. of the buffer's
    `parts` (the module doc). `parts` (weights, then each optimizer state with a row axis) give the
    host copies their dtypes and row shapes; the caller fills `host[0]` with the initial rows, then
    calls `empty(parts)`."""

    def __init__(self, rows: int, start: int, cache_rows: int, padding: bool, parts: list[torch.Tensor]):
        device = parts[0].device
        self.rows, self.start, self.cache_rows, self.padding = rows, start, cache_rows, padding
        self.host = [host_tensor((rows, *p.shape[1:]), p.dtype, device.type == "cuda") for p in parts]
        for state in self.host[1:]:
            state.zero_()
        self.slot_of = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
        self.id_of = torch.full((cache_rows + 1,), -1, dtype=torch.int64, device=device)
        self.used = torch.full((cache_rows + 1,), NEVER, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(cache_rows + 1, dtype=torch.bool, device=device)
        # distinct rows looked up, found cached; rows read in, written back
        self.stats = torch.zeros(4, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)  # batches placed: on the device, for graphs
        self.last_ids = 0  # ids of the batch placed before (its slots are kept)

    def _cache(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p[self.start:self.start + self.cache_rows] for p in parts]

    def reserve(self, n: int) -> None:
        """Check that a batch of `n` ids fits beside the one placed before, and count it as the last one
        (the host side of `place`, which `place_tensors` leaves out: a CUDA graph captures that)."""
        lru = self.cache_rows - self.padding
        if self.cache_rows < self.rows and self.last_ids + n > lru:
            raise UserError(f"host cache of {self.cache_rows:,} rows cannot hold a batch's {n:,} ids beside the "
                            f"previous batch's {self.last_ids:,}; raise --embedding-memory-gib or lower the "
                            f"batch size")
        self.last_ids = n

    def place(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> torch.Tensor:
        """The slots of flat `ids` (int64 [N]), every row brought into the cache; `train`: the batch's
        step updates the rows (written back when evicted)."""
        self.reserve(ids.numel())
        return self.place_tensors(ids, parts, train)

    @torch.no_grad()
    def place_tensors(self, ids: torch.Tensor, parts: list[torch.Tensor], train: bool) -> torch.Tensor:
        """`place` after `reserve`: tensor work only, no value read back, so a CUDA graph can hold it."""
        if not ids.numel():
            return ids.clone()
        self.clock += 1
        stamp = self.clock.expand(ids.numel())  # scatter_, not index_fill_ with a tensor value (that reads it)
        slot = self.slot_of[ids]
        hit = slot >= 0
        self.used.scatter_(0, torch.where(hit, slot.long(), self.cache_rows), stamp)  # hits: never victims
        missing, count = self._misses(ids, hit)
        hits = (self.used[:self.cache_rows] == self.clock).sum()
        victims = self._victims(count, ids.numel())
        cache = self._cache(parts)
        written = self._evict(victims, count, cache)
        self.stats += torch.stack([hits + count[0], hits, count[0], written])
        self._load(victims, missing, count, cache)
        slots = self.slot_of[ids].long()
        self.used.scatter_(0, slots, stamp)
        if train:
            self.dirty.index_fill_(0, slots, True)
        return slots

    def _misses(self, ids: torch.Tensor, hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of `ids` not cached, each once, packed first in [N] (-1 after), their count [1])."""
        n = ids.numel()
        code = -2 - torch.arange(n, dtype=torch.int32, device=ids.device)
        spare = self.rows
        self.slot_of.scatter_reduce_(0, torch.where(hit, spare, ids), torch.where(hit, -1, code), "amin")
        first = ~hit & (self.slot_of[ids] == code)
        self.slot_of[spare:].fill_(-1)  # a slice's fill_: `t[i] = scalar` would copy the scalar over, a sync
        return _pack(first, ids, n, -1)

    def _victims(self, count: torch.Tensor, n: int) -> torch.Tensor:
        """[n] slots: the `count` least recently used first (outside this batch and the previous one),
        then the spare slot."""
        c = self.cache_rows
        age = (self.clock - self.used[:c]).clamp_(max=AGES - 1)  # empty: the oldest; padding: < 0
        age = torch.where(age >= 2, age, 0)  # bucket 0: never taken
        # histc counts in shared memory (index_add_ would pile millions of atomics on 64 addresses); with
        # min < max given it reads nothing back
        hist = torch.histc(age.double(), bins=AGES, min=0, max=AGES)
        hist[:1].zero_()
        older = hist.flip(0).cumsum(0).flip(0)  # [AGES] slots in bucket b or older
        last = (older >= count).sum().view(1) - 1  # the youngest bucket to take from
        beyond = torch.cat([older[1:], older.new_zeros(1)]).index_select(0, last)  # (a 0-d index would sync)
        at_last = age == last
        take = (age > last) | (at_last & (torch.cumsum(at_last, 0) <= count - beyond))
        take &= age > 0
        return _pack(take, torch.arange(c, device=age.device), n, c)[0]

    def _evict(self, victims: torch.Tensor, count: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """Write the dirty rows of `victims` back (with their state) and unmap them; returns how many
        were written []."""
        old = self.id_of[victims]
        back = self.dirty[victims] & (old >= 0)
        src, dst = torch.where(back, victims, -1), torch.where(back, old, -1)
        copy_rows(cache, src, self.host, dst, count)
        self.slot_of.index_fill_(0, torch.where(old >= 0, old, self.rows), -1)
        return back.sum()

    def _load(self, victims: torch.Tensor, missing: torch.Tensor, count: torch.Tensor,
              cache: list[torch.Tensor]) -> None:
        """Read the `missing` rows (and their state) into `victims` and map them."""
        copy_rows(self.host, missing, cache, victims, count)
        self.slot_of[torch.where(missing >= 0, missing, self.rows)] = victims.to(torch.int32)
        self.slot_of[self.rows:].fill_(-1)
        self.id_of[victims] = missing
        self.dirty.index_fill_(0, victims, False)

    @torch.no_grad()
    def flush(self, parts: list[torch.Tensor]) -> None:
        """Write every dirty cached row and its state back to host memory (the rows stay cached)."""
        slots = self.dirty[:self.cache_rows].nonzero().squeeze(1)  # a host read: checkpoints only
        count = torch.tensor([slots.numel()], device=slots.device)
        copy_rows(self._cache(parts), slots, self.host, self.id_of[slots], count)
        self.dirty.zero_()

    @torch.no_grad()
    def empty(self, parts: list[torch.Tensor]) -> None:
        """Drop every cached row (call `flush` first to keep their updates); a bag's padding row goes
        back into slot 0."""
        self.slot_of.fill_(-1)
        self.id_of.fill_(-1)
        self.used.fill_(NEVER)
        self.dirty.zero_()
        self.last_ids = 0
        if self.padding and self.cache_rows:
            zero = torch.zeros(1, dtype=torch.int64, device=self.used.device)
            copy_rows(self.host, zero, self._cache(parts), zero, zero + 1)
            self.slot_of[:1].zero_()
            self.id_of[:1].zero_()
            self.used[:1].fill_(PINNED)


def _pack(mask: torch.Tensor, values: torch.Tensor, n: int, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([n]: `values` where `mask`, in order, then `fill`; how many [1]), without a host read."""
    order = torch.cumsum(mask, 0) - 1
    packed = torch.full((n + 1,), fill, dtype=values.dtype, device=values.device)
    packed[torch.where(mask & (order < n), order, n)] = values
    return packed[:n], mask.sum().view(1)


def copy_rows(srcs: list[torch.Tensor], src_rows: torch.Tensor, dsts: list[torch.Tensor], dst_rows: torch.Tensor,
              count: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for each pair of parts (a row's weights, then its optimizer
    state) and i < count[0] where both rows are >= 0; either side may be in (pinned) host memory, the
    other on the device."""
    if (srcs[0].is_cuda or dsts[0].is_cuda) and ops.kernels is not None:
        if src_rows.numel():
            programs = COPY_PROGRAMS * torch.cuda.get_device_properties(src_rows.device).multi_processor_count
            grid = (min(ops.triton.cdiv(src_rows.numel(), COPY_ROWS), programs),)
            for src, dst in zip(srcs, dsts):
                width = src[0].numel()
                ops.kernels.copy_rows_kernel[grid](src, src_rows, dst, dst_rows, count, W=width,
                                                   BLOCK_W=max(16, ops.triton.next_power_of_2(width)),
                                                   BLOCK_N=COPY_ROWS, num_warps=4)
        return
    n = int(count[0])  # the torch path reads the count back (CPU, or CUDA without Triton)
    s, d = src_rows[:n], dst_rows[:n]
    ok = (s >= 0) & (d >= 0)
    for src, dst in zip(srcs, dsts):
        dst[d[ok].to(dst.device)] = src[s[ok].to(src.device)].to(dst.device)


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An empty host tensor, page-locked where `pinned` (the GPU reads and writes it directly). A large
    one is allocated as usual and registered with CUDA where it lies: the pinned allocator would round
    it up to a power of two (a 20 GB table taking 32 GB)."""
    if not pinned:
        return torch.empty(shape, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.untyped_storage().nbytes()
    if nbytes >= REGISTER_BYTES:
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(out.data_ptr(), nbytes, 0)) == 0:
            weakref.finalize(out, cudart.cudaHostUnregister, out.data_ptr())
            return out
    return torch.empty(shape, dtype=dtype, pin_memory=True)
