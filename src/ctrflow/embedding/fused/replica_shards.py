"""Replicated tables updated in shards ("ZeRO-style") on the fused sharded path.

The replicas' gradient sums ([R, D] fp32 + touch counts, `replicas.replicated_grad`) are
reduce-scattered instead of all-reduced: each of the N ranks receives the sums of 1/N of the rows
(R padded to a multiple of N), steps only those rows of the fp32 weights and optimizer state, and
the next lookup's all-gather hands every rank every rank's rows, in the lookup dtype (bf16 on the
fast path), into a copy that the replicated lookups read. A rank sends half the bytes of the
all-reduce for the sums and a quarter (bf16) for the rows, and updates 1/N of the rows. The result
equals the all-reduce update (up to the reduction's summation order): every row is stepped once, by
its owner, from the same sums, and the lookup copy holds what a lookup of the fp32 rows rounds to.

The all-gather starts with the next step's lookups (`prefetch`) and is waited for at its first
replicated lookup, inside that step (a captured CUDA graph holds both ends). So the fp32 weights
and state rows a rank does not own go stale during training: whatever reads whole tables first calls
`sync` (a collective, outside the step), which all-gathers them when an update happened since the
last sync (a device-side counter, so graph replays count too). Loads write every row on every rank
(`mark_synced`). `comm_dtype` bf16 (opt-in, inexact) reduce-scatters the sums in bf16.

Measured on 4 H200s (MLPerf DLRM, `sharded_scale.py --graph`, benchmarks/NOTES.md): exact, and ~90 us a
step less GPU work on a rank (its update and the bf16 lookups), but no faster (4.31 against 4.30 ms; bf16
reduce-scatter 4.30): the all-reduce it replaces was not on the step's critical path. Hence an option of
`FusedShardedEmbeddingCollection` (`replica_update="sharded"`), not its default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ctrflow.embedding.fused.collection import FusedEmbeddingCollection
from ctrflow.embedding.fused.replicas import apply_rows

# torch >= 2.13 names them *_single (the old names warn); older releases have only the old names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SOURCES = ("weight", "state1", "state2")


class ReplicaShards(nn.Module):
    """The sharded update of one replica buffer of `rows` x `dim` on rank `rank` of `world`: rows
    [lo, hi) are this rank's; `group` runs the collectives (None: the default one); lookups read
    `lookup_weight()` ([rows, dim] in `lookup_dtype`), current after `start_gather`'s work."""

    def __init__(self, rows: int, dim: int, world: int, rank: int, group=None,
                 lookup_dtype: torch.dtype = torch.float32, comm_dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if comm_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"replica comm dtype must be fp32 or bf16, got {comm_dtype}")
        self.rows, self.dim, self.world, self.group = rows, dim, world, group
        self.chunk = -(-rows // world)  # rows per rank; the last ranks' may be padding
        self.padded = self.chunk * world
        self.lo, self.hi = min(rank * self.chunk, rows), min((rank + 1) * self.chunk, rows)
        self.lookup_dtype, self.comm_dtype = lookup_dtype, comm_dtype
        # updates so far (device side: graph replays count); `synced` holds its value at each source's last sync
        self.register_buffer("version", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.synced = dict.fromkeys(SOURCES, 0)
        self.scratch: dict[str, torch.Tensor] = {}  # reused every step (a captured graph keeps their addresses)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.scratch.clear()
        return self

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer made once (padding rows stay zero)."""
        buf = self.scratch.get(name)
        if buf is None:
            buf = self.scratch[name] = torch.zeros(shape, dtype=dtype, device=self.version.device)
        return buf

    def start_reduce(self, acc: torch.Tensor, counts: bool) -> list:
        """Start the reduce-scatter of acc ([padded * (dim + 1)] fp32: sums, then touch counts) into
        this rank's rows (the counts only with `counts`); returns the works to wait for."""
        c, d, p = self.chunk, self.dim, self.padded
        own = self._buffer("own", (c * (d + 1),), torch.float32)
        sums = acc[:p * d]
        if self.comm_dtype == torch.bfloat16:  # inexact: each rank's sums rounded, then summed in bf16
            send = self._buffer("send", (p * d,), torch.bfloat16)
            send.copy_(sums)
            works = [_REDUCE_SCATTER(self._buffer("own_low", (c * d,), torch.bfloat16), send, group=self.group,
                                     async_op=True)]
        else:
            works = [_REDUCE_SCATTER(own[:c * d], sums, group=self.group, async_op=True)]
        if counts:
            works.append(_REDUCE_SCATTER(own[c * d:], acc[p * d:], group=self.group, async_op=True))
        return works

    @torch.no_grad()
    def apply(self, replica: FusedEmbeddingCollection, counts: bool) -> None:
        """One optimizer step of this rank's rows from the reduced sums (after `start_reduce`'s works)."""
        n, c, d = self.hi - self.lo, self.chunk, self.dim
        own = self.scratch["own"]
        sums = self.scratch["own_low"].float() if self.comm_dtype == torch.bfloat16 else own[:c * d]
        apply_rows(sums.view(c, d)[:n], own[c * d:c * d + n] if counts else None, replica, self.lo, self.hi,
                   self.world)
        self.version.add_(1)

    def start_gather(self, replica: FusedEmbeddingCollection):
        """Start the all-gather of every rank's rows of `replica.weight`, in the lookup dtype, into
        the lookup copy; returns its work (None for one process)."""
        own = self._buffer("own_rows", (self.chunk, self.dim), self.lookup_dtype)
        own[:self.hi - self.lo].copy_(replica.weight[self.lo:self.hi])
        return _ALL_GATHER(self._buffer("rows", (self.padded, self.dim), self.lookup_dtype), own,
                           group=self.group, async_op=True)

    def lookup_weight(self) -> torch.Tensor:
        """[rows, dim] in the lookup dtype: what the replicated lookups read."""
        return self._buffer("rows", (self.padded, self.dim), self.lookup_dtype)[:self.rows]

    @torch.no_grad()
    def sync(self, replica: FusedEmbeddingCollection, source: str) -> None:
        """Make `source` ("weight", "state1", "state2") of `replica` whole on every rank: the rows
        of every rank, if an update came since its last sync. A collective: every rank calls it."""
        version = int(self.version)  # a device-to-host read; outside the step
        if self.synced[source] == version:
            return
        st = replica.row_state
        tensor = {"weight": replica.weight, "state1": st.state1, "state2": st.state2}[source]
        if tensor.shape[0] == self.rows:  # (an optimizer without this state keeps a one-element placeholder)
            own = tensor.new_zeros(self.chunk, *tensor.shape[1:])
            own[:self.hi - self.lo] = tensor[self.lo:self.hi]
            whole = tensor.new_empty(self.padded, *tensor.shape[1:])
            _ALL_GATHER(whole, own, group=self.group)
            tensor.copy_(whole[:self.rows])
        self.synced[source] = version

    def mark_synced(self, *sources: str) -> None:
        """`sources` were just written whole on every rank (a load)."""
        version = int(self.version)
        for source in sources:
            self.synced[source] = version
