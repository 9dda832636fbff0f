"""One host table of the fused collection: its rows in host memory, a cache of slots in the one buffer.

`FusedEmbeddingCollection` keeps a table the plan places in host memory as `cache_rows` rows of its
one buffer (the slots), their optimizer state in `row_state`, and the whole table, weights and state,
in host memory (`host`). A batch's ids of the table become slot numbers (`place`), and the usual gather,
bag and update kernels run on them unchanged. The bookkeeping lives beside the buffer. Placing a batch
is three parts: `reserve`, the host's check of the batch's size against the cache; `place_tensors`,
the bookkeeping, which reads nothing back to the host, so a CUDA graph can hold it
(`ctrflow.embedding.fused.cached` replays it); and `move`, the rows' copies it decides:

- `slot_of` [rows] int32 (-1: not cached), `seen` [rows] uint8 (the batches that looked the row up,
  cached or not, at most `CAP`, halved every `HALF_LIFE` batches), `id_of` [C] int64 (-1: empty),
  `used` [C] int64 (the number of the last batch that looked the slot up, counted by `clock` on the
  device), `dirty` [C] bool; each with `SPARE` entries at its end, where the writes of masked-out
  lanes land (lane i on entry i % SPARE), so that no tensor's size depends on the ids.
- Misses: the first occurrence of each row not cached claims the row in `slot_of` (the least code
  wins), then the claimed rows are packed first; their count stays on the device.
- Victims: the least frequently used rows, counted over batches with a half-life (LFU with decay, as
  FBGEMM's LFU cache keeps a count per row): slots go into `BUCKETS` buckets by their row's `seen`,
  empty slots in the coldest, and the coldest buckets are taken whole, the last one in slot order,
  until the misses are covered. A slot of this batch or of the previous one is never taken (that
  step may still be running beside a prefetch), so a cache that holds two batches' ids always has
  room; a smaller one is refused before the batch is placed (the batch's size is known on the host).
  Under the power laws of click logs most misses are rows looked up once in a long while: a count
  that outlives the row's stay in the cache keeps them from evicting the rows looked up every few
  batches, which LRU over batches does. On the DLRMv2 shape's ids (`benchmarks/cache_model.py`) LRU
  misses 39 % more rows than a cache of the most likely rows, and this policy 7 % more (measured on an
  H200, `benchmarks/NOTES.md`).
- Moves, each list in row order: victims holding rows a training batch looked up (dirty) are written
  back to host memory with their state, and the missing rows and their state are read in. The GPU
  writes the rows leaving straight into the host table (registered with CUDA) with a kernel of 132
  programs, while the CPU gathers the rows arriving in host memory (many threads: random rows at tens
  of GB/s) into one block that crosses the bus in a bulk copy, which the copy engines run beside the
  step. Random rows cross the bus through the host's address translation at about 29 M a second
  either way, about twice that in row order; the writes are posted and cost the CPU nothing, and the CPU's gathers keep the reads off
  the SMs (benchmarks/NOTES.md, "Tables in host memory"). `move` reads back the copies' sizes and
  the rows arriving (`cached.CachedTables` runs it in a thread of its own).
- `stats` counts the distinct rows looked up and found cached, and the rows read in and written back.
- A multi-hot table's padding row 0 stays in slot 0 (the kernels skip id 0 of a bag).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from ctrflow.embedding.fused import ops
from ctrflow.errors import UserError

NEVER = -1  # `used` of an empty slot
PINNED = 2**62  # `used` of the padding slot: never a victim
BUCKETS = 64  # victim buckets: few enough to count in registers (`kernels.bucket_histogram_kernel`)
CAP = BUCKETS - 2  # the largest count: bucket BUCKETS - 1 - count, bucket 0 never taken
# batches between halvings of the counts: long enough that the rows at the edge of a DLRMv2 cache, looked up
# about once in 100 batches, count above the rows looked up once; short enough to follow ids that drift
HALF_LIFE = 1024
BUCKET_BLOCK = 4096  # slots a program of `bucket_histogram_kernel` counts
WRITE_ROWS = 32  # rows a program of `write_rows_kernel` writes at a time
# its programs, each looping over blocks: random rows cross at the same rate from 132 programs to 1,056
# (the host's address translation bounds them), and fewer leave more of the GPU to the step beside them
WRITE_PROGRAMS = 132
# entries past the end of each bookkeeping tensor for the writes of masked-out lanes: spread over many,
# since writes to one address serialize (a DLRMv2 batch's hits, most of its ids, claiming one spare
# entry took 1 ms of the step's 9 ms of bookkeeping on an H200)
SPARE = 1024


class Moves(NamedTuple):
    """The copies a placement decided, on the buffer's device: rows `rows_in` of host memory into slots
    `slots_in`, slots `slots_out` to rows `rows_out`, each list packed first, `counts` [2] long."""
    rows_in: torch.Tensor
    slots_in: torch.Tensor
    slots_out: torch.Tensor
    rows_out: torch.Tensor
    counts: torch.Tensor


class SlotCache:
    """Table rows [rows, ...] in host memory, `cache_rows` of them in slots `start`.. of the buffer's
    `parts` (the module doc). `parts` (weights, then each optimizer state with a row axis) give the
    host copies their dtypes and row shapes; the caller fills `host[0]` with the initial rows, then
    calls `empty(parts)`."""

    def __init__(self, rows: int, start: int, cache_rows: int, padding: bool, parts: list[torch.Tensor]):
        device = parts[0].device
        self.rows, self.start, self.cache_rows, self.padding = rows, start, cache_rows, padding
        self.host = [torch.empty((rows, *p.shape[1:]), dtype=p.dtype) for p in parts]
        for state in self.host[1:]:
            state.zero_()
        # the GPU writes evicted rows into host tables it can address (`move`)
        self.mapped = device.type == "cuda" and ops.kernels is not None and all(map(register, self.host))
        self.slot_of = torch.full((rows + SPARE,), -1, dtype=torch.int32, device=device)
        self.seen = torch.zeros(rows + SPARE, dtype=torch.uint8, device=device)
        self.id_of = torch.full((cache_rows + SPARE,), -1, dtype=torch.int64, device=device)
        self.used = torch.full((cache_rows + SPARE,), NEVER, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(cache_rows + SPARE, dtype=torch.bool, device=device)
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
        slots, moves = self.place_tensors(ids, parts, train)
        self.move(moves, parts)
        return slots

    @torch.no_grad()
    def place_tensors(self, ids: torch.Tensor, parts: list[torch.Tensor],
                      train: bool) -> tuple[torch.Tensor, Moves]:
        """`place` after `reserve`, without the rows' moves: the slots of `ids`, with every row mapped,
        and the `Moves` that bring the rows there (`move`). Tensor work only, no value read back, so a
        CUDA graph can hold it."""
        n = ids.numel()
        if not n:
            return ids.clone(), Moves(*(ids.new_full((0,), -1) for _ in range(4)), ids.new_zeros(2))
        lane = torch.arange(n, device=ids.device)
        spare = lane & (SPARE - 1)
        spare_rows, spare_slots = spare + self.rows, spare + self.cache_rows
        self.clock += 1
        # every batch shifts the counts by 0 or 1: deciding on the host would read the clock back
        self.seen.bitwise_right_shift_((self.clock % HALF_LIFE == 0).to(torch.uint8))
        self.seen[ids] = (self.seen[ids] + 1).clamp_(max=CAP)  # a row's repeats in a batch write the same value
        stamp = self.clock.expand(n)  # scatter_, not index_fill_ with a tensor value (that reads it)
        slot = self.slot_of[ids]
        hit = slot >= 0
        self._stamp(torch.where(hit, slot.long(), spare_slots), stamp)  # hits: never victims
        missing, count = self._misses(ids, hit, lane, spare_rows)
        hits = (self.used[:self.cache_rows] == self.clock).sum()
        victims = self._victims(count, n)
        victims = torch.where(victims >= 0, victims, spare_slots)
        missing, victims = _by_row(missing, [missing, victims], self.rows)
        old = self.id_of[victims]
        back = self.dirty[victims] & (old >= 0)  # evicted rows a training batch changed: written back
        (back_slots, back_rows), written = _pack(back, [victims, old], -1)
        back_rows, back_slots = _by_row(back_rows, [back_rows, back_slots], self.rows)
        self.stats += torch.stack([hits + count[0], hits, count[0], written[0]])
        self.slot_of.index_fill_(0, torch.where(old >= 0, old, spare_rows), -1)
        self.slot_of[torch.where(missing >= 0, missing, spare_rows)] = victims.to(torch.int32)
        self.slot_of[self.rows:].fill_(-1)
        self.id_of[victims] = missing
        self.dirty.index_fill_(0, victims, False)
        self._stamp(victims, stamp)  # the slots of this batch's hits have theirs
        if train:  # every slot stamped: a pass over the slots, where a scatter's writes of hot rows serialize
            self.dirty[:self.cache_rows] |= self.used[:self.cache_rows] == self.clock
        moves = Moves(missing, victims, back_slots, back_rows, torch.cat([count, written]))
        return self.slot_of[ids].long(), moves

    def _stamp(self, slots: torch.Tensor, stamp: torch.Tensor) -> None:
        """Mark `slots` looked up by this batch; the padding row keeps slot 0."""
        self.used.scatter_(0, slots, stamp)
        if self.padding:
            self.used[:1].fill_(PINNED)

    def _misses(self, ids: torch.Tensor, hit: torch.Tensor, lane: torch.Tensor,
                spare_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of `ids` not cached, each once, packed first in [N] (-1 after), their count [1]);
        `lane` [N] 0.., `spare_rows` [N] where a lane masked out writes."""
        code = -2 - lane.int()
        self.slot_of.scatter_reduce_(0, torch.where(hit, spare_rows, ids), torch.where(hit, -1, code), "amin")
        first = ~hit & (self.slot_of[ids] == code)
        self.slot_of[self.rows:].fill_(-1)  # a slice's fill_: `t[i] = scalar` would copy the scalar over, a sync
        (missing,), count = _pack(first, [ids], -1)
        return missing, count

    def _victims(self, count: torch.Tensor, n: int) -> torch.Tensor:
        """[n] slots: the `count` least frequently used first (outside this batch and the previous one),
        then -1."""
        c = self.cache_rows
        rows = self.id_of[:c]
        bucket = BUCKETS - 1 - self.seen[torch.where(rows >= 0, rows, self.rows)].long()  # empty: the coldest
        bucket = torch.where(self.clock - self.used[:c] >= 2, bucket, 0)  # bucket 0: never taken
        hist = count_buckets(bucket)
        hist[:1].zero_()
        colder = hist.flip(0).cumsum(0).flip(0)  # [BUCKETS] slots in bucket b or colder
        last = (colder >= count).sum().view(1) - 1  # the warmest bucket to take from
        beyond = torch.cat([colder[1:], colder.new_zeros(1)]).index_select(0, last)  # (a 0-d index would sync)
        at_last = bucket == last
        take = (bucket > last) | (at_last & (torch.cumsum(at_last, 0) <= count - beyond))
        take &= bucket > 0
        return torch.nonzero_static(take, size=n, fill_value=-1).squeeze(1)

    @torch.no_grad()
    def move(self, moves: Moves, parts: list[torch.Tensor]) -> None:
        """Make the copies of `moves` on the current stream: the rows leaving go back to host memory with
        their state, then the rows arriving are gathered in host memory by the CPU, copied in and
        scattered into their slots. Where the host table is registered with CUDA (`mapped`) the GPU
        writes the rows leaving into it (`kernels.write_rows_kernel`), queued before the CPU's gathers
        and run beside them: host memory is current once the stream has passed them. Elsewhere the
        rows leaving are copied out and scattered by the CPU first. Reads back the copies' sizes and the
        rows arriving."""
        n_in, n_out = (int(n) for n in moves.counts.tolist())
        cache = self._cache(parts)
        rows_in = moves.rows_in[:n_in].cpu()
        if n_out and self.mapped:
            for h, c in zip(self.host, cache):
                write_rows(c, moves.slots_out, h, moves.rows_out, moves.counts[1:], n_out)
        elif n_out:
            rows_out = moves.rows_out[:n_out].cpu()
            for h, c in zip(self.host, cache):
                h.index_copy_(0, rows_out, c[moves.slots_out[:n_out]].cpu())
        for h, c in zip(self.host, cache) if n_in else []:
            # a pinned block is reused only after the copies queued from it ran (torch's host allocator)
            staged = torch.empty((n_in, *h.shape[1:]), dtype=h.dtype, pin_memory=c.is_cuda)
            torch.index_select(h, 0, rows_in, out=staged)
            c.index_copy_(0, moves.slots_in[:n_in], staged.to(c.device, non_blocking=True))

    @torch.no_grad()
    def flush(self, parts: list[torch.Tensor]) -> None:
        """Write every dirty cached row and its state back to host memory (the rows stay cached)."""
        slots = self.dirty[:self.cache_rows].nonzero().squeeze(1)  # a host read: checkpoints only
        rows = self.id_of[slots].cpu()
        for h, c in zip(self.host, self._cache(parts)):
            h.index_copy_(0, rows, c[slots].cpu())
        self.dirty.zero_()

    @torch.no_grad()
    def empty(self, parts: list[torch.Tensor]) -> None:
        """Drop every cached row (call `flush` first to keep their updates); a bag's padding row goes
        back into slot 0."""
        self.slot_of.fill_(-1)
        self.seen.zero_()
        self.id_of.fill_(-1)
        self.used.fill_(NEVER)
        self.dirty.zero_()
        self.last_ids = 0
        if self.padding and self.cache_rows:
            for h, c in zip(self.host, self._cache(parts)):
                c[:1].copy_(h[:1])
            self.slot_of[:1].zero_()
            self.id_of[:1].zero_()
            self.used[:1].fill_(PINNED)


def register(host: torch.Tensor) -> bool:
    """Register `host` (a CPU tensor) with CUDA, so that kernels may address it, until it is freed. False
    where CUDA refuses (the system's limit on locked memory, say): the CPU then writes its rows."""
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(host.data_ptr(), host.untyped_storage().nbytes(), 0)) != 0:
        try:  # the refusal stays the runtime's last error, which torch's next launch check would report
            torch.zeros(1, device="cuda")
        except RuntimeError:
            pass
        return False
    weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
    return True


def write_rows(src: torch.Tensor, slots: torch.Tensor, host: torch.Tensor, rows: torch.Tensor,
               count: torch.Tensor, most: int) -> None:
    """host[rows[i]] = src[slots[i]] for i < count[0] (on the device, at most `most`), written by the GPU
    into `host`, a registered host tensor (`register`), on the current stream."""
    width = src[0].numel()
    grid = (min(ops.triton.cdiv(most, WRITE_ROWS), WRITE_PROGRAMS),)
    ops.kernels.write_rows_kernel[grid](src, slots, host, rows, count, W=width,
                                        BLOCK_W=max(16, ops.triton.next_power_of_2(width)), BLOCK_N=WRITE_ROWS)


def count_buckets(bucket: torch.Tensor) -> torch.Tensor:
    """[BUCKETS] how many of `bucket` (int64 in [0, BUCKETS)) fall in each, without a host read. On a GPU
    each block is counted in registers: `torch.histc`'s shared-memory atomics, most of them on one or
    two buckets, took ~1.3 ms for a table's 12 M slots."""
    if bucket.is_cuda and ops.kernels is not None:
        hist = torch.zeros(BUCKETS, dtype=torch.int32, device=bucket.device)
        grid = (ops.triton.cdiv(bucket.numel(), BUCKET_BLOCK),)
        ops.kernels.bucket_histogram_kernel[grid](bucket, hist, bucket.numel(), BUCKETS=BUCKETS, BLOCK=BUCKET_BLOCK)
        return hist
    return torch.histc(bucket.double(), bins=BUCKETS, min=0, max=BUCKETS)  # min < max given: it reads nothing back


def _by_row(rows: torch.Tensor, values: list[torch.Tensor], last: int) -> list[torch.Tensor]:
    """`values` ordered by `rows` (-1, the packing's fill, last): moves in row order touch each page of
    host memory once for the several rows it holds (a row's 4-byte state most of all)."""
    key = torch.where(rows >= 0, rows, last)
    order = (key.int() if last < 2**31 else key).argsort()  # 4-byte keys: half the sort's passes
    return [v[order] for v in values]


def _pack(mask: torch.Tensor, values: list[torch.Tensor], fill: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(each of `values` [N] where `mask` [N], in order, then `fill`, [N]; how many [1]), without a host
    read."""
    at = torch.nonzero_static(mask, size=mask.numel(), fill_value=-1).squeeze(1)
    found = at >= 0
    at.clamp_(min=0)
    return [torch.where(found, v[at], fill) for v in values], mask.sum().view(1)
