"""The sharded embedding collection: the same lookups as `EmbeddingCollection`, tables split over ranks.

One step on rank r with local ids [b, F]:
1. for every model-parallel shard (table-, row- or column-wise) pick the ids it must serve
   (row-wise: the ids in its row range, made shard-local);
2. exchange per-shard counts, then the ids, with all_to_all (variable splits);
3. each owner looks up the ids it received in its local shard;
4. the embeddings travel back by all_to_all and are assembled into [b, F, D]
   (row pieces scattered to their samples, column pieces concatenated);
replicated (data-parallel) tables are looked up locally. Backward runs the exchanges in reverse;
gradients are divided by the world size, matching DDP's averaging of the dense gradients, so a
step on N ranks equals a step of the plain collection on the global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import nn

from ctrflow.embedding.collection import table_rows
from ctrflow.embedding.comm import exchange, exchange_differentiable, group_size, replicated_lookup, scale_grad
from ctrflow.embedding.plan import Shard, ShardingPlan
from ctrflow.embedding.tables import TableConfig, check_ids

_ON_MAIN: ContextVar[bool] = ContextVar("gathered_on_main", default=False)
Init = Callable[[TableConfig, int, Shard], torch.Tensor]  # (table, table index, shard) -> shard weights


class ShardedEmbeddingCollection(nn.Module):
    """ids [b, F] -> [b, F, D] with tables placed by a `ShardingPlan`; one parameter per local shard.

    `weights[table.name]` is this rank's shard of that table (absent where it holds none), so
    `state_dict()` holds local shards; topology-independent checkpoints go through
    `full_weights()` (a collective: call it on every rank) and `load_full_weights()`.
    """

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, init: Init, group=None,
                 device: torch.device | str = "cpu", check: bool = True):
        super().__init__()
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"all tables of one collection need one embedding_dim, got {sorted(dims)}")
        self.tables, self.embedding_dim, self.plan, self.group = list(tables), dims.pop(), plan, group
        self.world_size = group_size(group)
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, process group has {self.world_size}")
        self.check, self.device = check, torch.device(device)
        self.weights = nn.ParameterDict()
        for i, t in enumerate(self.tables):
            shard = plan.tables[t.name].shard_on(self.rank)
            if shard is not None:
                self.weights[t.name] = nn.Parameter(init(t, i, shard).to(device))
        # per destination rank: the model-parallel shards it serves, in one order every rank agrees on
        self.served = [[(f, t.name, s) for f, t in enumerate(self.tables) if plan.tables[t.name].sharding != "data"
                        for s in plan.tables[t.name].shards if s.rank == r] for r in range(self.world_size)]
        self.replicated = [f for f, t in enumerate(self.tables) if plan.tables[t.name].sharding == "data"]
        self.flat = [x for served in self.served for x in served]  # dest-major, the send order
        self.row_slots: dict[int, list[tuple[int, Shard]]] = {}  # row-split feature -> (flat index, shard)
        for i, (f, _name, s) in enumerate(self.flat):
            if s.num_rows != self.tables[f].num_embeddings:
                self.row_slots.setdefault(f, []).append((i, s))
        for slots in self.row_slots.values():
            slots.sort(key=lambda x: x[1].rows[0])
        self.row_starts = {f: torch.tensor([s.rows[0] for _, s in slots], device=self.device)
                           for f, slots in self.row_slots.items()}

    @classmethod
    def from_collection(cls, collection, plan: ShardingPlan, group=None, device="cpu", check: bool = True):
        """Shard a plain `EmbeddingCollection`, keeping its current weights (a deferred one's
        rows are drawn shard by shard: no process holds a whole table)."""

        def take(_t: TableConfig, i: int, s: Shard) -> torch.Tensor:
            return table_rows(collection, i, s.rows[0], s.rows[1])[:, s.cols[0]:s.cols[1]].clone()

        return cls(collection.tables, plan, take, group, device, check)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, F] of this rank's samples -> [b, F, D]; a collective (every rank calls it each step)."""
        if self.check:
            check_ids(ids, self.tables)
        b = ids.shape[0]
        pieces = self._lookup_model_parallel(ids)
        if self.replicated:
            values = replicated_lookup([ids[:, f] for f in self.replicated],
                                       [self.weights[self.tables[f].name] for f in self.replicated],
                                       self.group, float(self.world_size))
            for f, v in zip(self.replicated, values):
                pieces[f] = [(None, None, v)]
        columns = [self._assemble(pieces[f], b) for f in range(len(self.tables))]
        return torch.stack(columns, dim=1)  # [b, F, D]

    def _lookup_model_parallel(self, ids: torch.Tensor) -> list[list]:
        """Route ids to shard owners, look them up there, route embeddings back (steps 1-4)."""
        if not self.flat:
            return [[] for _ in self.tables]
        counts, grouped = self._count(ids)
        per_dest = [len(served) for served in self.served]
        mine = len(self.served[self.rank])
        recv_counts = exchange(counts, [mine] * self.world_size, per_dest, self.group)
        both = torch.cat([counts, recv_counts]).tolist()  # the step's one host sync: split sizes
        counts, recv_counts = both[:len(self.flat)], both[len(self.flat):]
        recv_counts = [recv_counts[r * mine:(r + 1) * mine] for r in range(self.world_size)]
        send, positions = self._pieces(ids, grouped, counts)
        recv_ids = exchange(torch.cat(send), [sum(c) for c in recv_counts], _chunk_sums(counts, per_dest), self.group)
        looked_up = self._lookup_local(recv_ids, recv_counts)
        dims_mine = [s.num_cols for _, _, s in self.served[self.rank]]
        back_out = [sum(c * d for c, d in zip(row, dims_mine)) for row in recv_counts]
        sizes = [c * s.num_cols for c, (_, _, s) in zip(counts, self.flat)]
        returned = exchange_differentiable(looked_up, _chunk_sums(sizes, per_dest), back_out, self.group)
        returned = scale_grad(returned, 1.0 / self.world_size)
        pieces: list[list] = [[] for _ in self.tables]
        for (f, _name, s), pos, chunk, c in zip(self.flat, positions, returned.split(sizes), counts):
            pieces[f].append((s, pos, chunk.view(c, s.num_cols)))
        return pieces

    def _count(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Ids per flat shard as one device tensor; row-split features grouped by owning shard
        (shard-local ids sorted by owner, and the sample position of each)."""
        counts = [torch.full((1,), ids.shape[0], dtype=torch.int64, device=ids.device)] * len(self.flat)
        grouped = {}
        for f, slots in self.row_slots.items():
            col = ids[:, f].contiguous()
            starts = self.row_starts[f]
            owner = torch.bucketize(col, starts[1:], right=True)  # [b] index into `slots`
            order = torch.argsort(owner, stable=True)
            grouped[f] = (col[order] - starts[owner[order]], order)
            per_shard = torch.bincount(owner, minlength=len(slots))
            for k, (i, _s) in enumerate(slots):
                counts[i] = per_shard[k:k + 1]
        return torch.cat(counts), grouped

    def _pieces(self, ids: torch.Tensor, grouped: dict, counts: list[int]) -> tuple[list, list]:
        """Per flat shard: the ids to send and the sample positions they fill (None: all samples)."""
        send: list = [None] * len(self.flat)
        positions: list = [None] * len(self.flat)
        for f, slots in self.row_slots.items():
            local, order = grouped[f]
            sizes = [counts[i] for i, _ in slots]
            for (i, _s), part, pos in zip(slots, local.split(sizes), order.split(sizes)):
                send[i], positions[i] = part, pos
        for i, (f, _name, _s) in enumerate(self.flat):
            if send[i] is None:
                send[i] = ids[:, f]
        return send, positions

    def _lookup_local(self, recv_ids: torch.Tensor, recv_counts: list[list[int]]) -> torch.Tensor:
        """Look up the ids every source sent to this rank's shards; flat, source-major, shard-minor."""
        served = self.served[self.rank]
        if not served:
            return torch.zeros(0, device=recv_ids.device, requires_grad=True)
        chunks = recv_ids.split([c for row in recv_counts for c in row])
        k = len(served)
        per_source: list[list[torch.Tensor]] = [[] for _ in recv_counts]
        for j, (_f, name, _s) in enumerate(served):
            shard_ids = torch.cat([chunks[src * k + j] for src in range(len(recv_counts))])
            emb = nn.functional.embedding(shard_ids, self.weights[name], sparse=True)  # [n, d_shard]
            for src, part in enumerate(emb.split([row[j] for row in recv_counts])):
                per_source[src].append(part.reshape(-1))
        return torch.cat([p for parts in per_source for p in parts])

    def _assemble(self, pieces: list, b: int) -> torch.Tensor:
        """One feature's [b, D] from its pieces: whole, row pieces scattered, or column pieces joined."""
        if len(pieces) == 1 and pieces[0][1] is None and pieces[0][2].shape[1] == self.embedding_dim:
            return pieces[0][2]
        if pieces[0][1] is not None:  # row-wise
            pos = torch.cat([p for _, p, _ in pieces])
            values = torch.cat([v for _, _, v in pieces])
            return values.new_zeros(b, self.embedding_dim).index_copy(0, pos, values)
        return torch.cat([v for _, _, v in sorted(pieces, key=lambda p: p[0].cols[0])], dim=1)

    def local_slice(self, name: str, full: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of a whole-table tensor ([N, D] weights-like or [N] per-row), or None."""
        shard = self.plan.tables[name].shard_on(self.rank)
        if shard is None:
            return None
        rows = full[shard.rows[0]:shard.rows[1]]
        return rows[:, shard.cols[0]:shard.cols[1]] if full.dim() == 2 else rows

    def gather_table(self, name: str, local: torch.Tensor | None, per_row: bool = False) -> torch.Tensor:
        """The whole-table tensor from every rank's shard of it (collective; returned on CPU).

        `per_row`: tensors of one value per row (row-wise Adagrad state), equal across column shards.
        """
        table = next(t for t in self.tables if t.name == name)
        return gather_whole(table, self.plan.tables[name], local, self.group, self.device, per_row)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name, on CPU (collective: every rank must call it)."""
        return {t.name: self.full_table(t.name) for t in self.tables}

    def full_table(self, name: str) -> torch.Tensor:
        """One whole table, on CPU (collective): checkpoints gather and write one table at a time."""
        return self.gather_table(name, self.weights[name] if name in self.weights else None)

    @torch.no_grad()
    def load_full_weights(self, tables: dict[str, torch.Tensor]) -> None:
        """Take whole tables by name (e.g. from a checkpoint written on any number of ranks)."""
        for t in self.tables:
            full = tables[t.name]
            if tuple(full.shape) != (t.num_embeddings, t.embedding_dim):
                raise ValueError(f"table {t.name}: got shape {tuple(full.shape)}, "
                                 f"expected {(t.num_embeddings, t.embedding_dim)}")
            part = self.local_slice(t.name, full)
            if part is not None:
                self.weights[t.name].copy_(part)

    def reduce_row_sums(self, name: str, partial: torch.Tensor) -> torch.Tensor:
        """Sum per-row partial sums over the column shards of a table (identity unless column-wise)."""
        if self.plan.tables[name].sharding != "column" or self.world_size == 1:
            return partial
        total = partial.clone()
        dist.all_reduce(total, group=self.group)
        return total


@contextmanager
def gathered_on_main() -> Iterator[None]:
    """Within: `gather_whole` assembles whole tables on the group's first rank only (a checkpoint
    that rank writes); the other ranks get zero-stride placeholders of the right shape, which hold
    no memory and must not be read. Without it every rank would hold every whole table at once."""
    token = _ON_MAIN.set(True)
    try:
        yield
    finally:
        _ON_MAIN.reset(token)


def gather_whole(table: TableConfig, tp, local: torch.Tensor | None, group, device, per_row: bool = False
                 ) -> torch.Tensor:
    """Whole `table` ([N, D], or [N] with `per_row`) from each rank's shard `local` under the table's
    plan `tp` (collective over `group`; a replica or a single process returns its own copy; on CPU)."""
    world = group_size(group)
    shape = (table.num_embeddings,) if per_row else (table.num_embeddings, table.embedding_dim)
    on_main = _ON_MAIN.get() and world > 1
    main = not on_main or dist.get_rank(group) == 0  # this rank returns the whole table
    if tp.sharding == "data" or world == 1:
        return local.detach().cpu().clone() if main else torch.zeros(()).expand(shape)
    if on_main:
        return _send_to_main(table, tp, local, group, device, per_row, shape)
    numel = [s.num_rows * (1 if per_row else s.num_cols) for s in tp.shards]
    mine = torch.zeros(max(numel), device=device)
    if local is not None:
        mine[: local.numel()] = local.detach().reshape(-1)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    full = torch.empty(shape)
    for s, n in zip(tp.shards, numel):
        _place(full, s, parts[s.rank][:n].cpu(), per_row)
    return full


def _send_to_main(table: TableConfig, tp, local: torch.Tensor | None, group, device, per_row: bool,
                  shape: tuple) -> torch.Tensor:
    """`gather_whole` under `gathered_on_main`: each shard's holder sends it to the group's first
    rank, one shard at a time, into a buffer of that shard's size. (A gather needs one buffer per
    rank of the largest shard's size: a table kept whole on one rank cost world x its size on the
    first rank's device, 8 x 20 GB for MLPerf's largest table on 8 GPUs.)"""
    rank = dist.get_rank(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    full = torch.empty(shape) if rank == 0 else None
    for s in tp.shards:
        if s.rank == 0 and rank == 0:
            _place(full, s, local.detach().cpu(), per_row)
        elif rank == s.rank:
            dist.send(local.detach().float().contiguous(), first, group=group)  # whole tables are fp32
        elif rank == 0:
            part = torch.empty((s.num_rows,) if per_row else (s.num_rows, s.num_cols), device=device)
            holder = dist.get_global_rank(group, s.rank) if group is not None else s.rank
            dist.recv(part, holder, group=group)
            _place(full, s, part.cpu(), per_row)
    return full if rank == 0 else torch.zeros(()).expand(shape)  # the placeholder of `gathered_on_main`


def _place(full: torch.Tensor, s, part: torch.Tensor, per_row: bool) -> None:
    """Shard `s`'s values into the whole table."""
    if per_row:
        full[s.rows[0]:s.rows[1]] = part.reshape(-1)
    else:
        full[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] = part.view(s.num_rows, s.num_cols)


def _chunk_sums(values: list[int], chunk_lengths: list[int]) -> list[int]:
    sums, start = [], 0
    for n in chunk_lengths:
        sums.append(sum(values[start:start + n]))
        start += n
    return sums
