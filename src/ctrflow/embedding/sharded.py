"""The sharded embedding collection: the plain collection's lookups and pooling, tables split over ranks.

One step on rank r with local ids [b, S] (each table's slots consecutive: one id for a one-hot table,
`length` for a multi-hot bag):
1. for every model-parallel shard (table-, row- or column-wise) pick the ids it must serve
   (row-wise: the ids in its row range, made shard-local; a bag's with their bag numbers, no padding);
2. exchange per-shard counts, then the ids, with all_to_all (variable splits);
3. each owner looks up the ids it received in its local shard and pools the bags (whole bags, or a
   row-wise bag's partial sums: `ctrflow.embedding.bags` says why the owner pools);
4. the vectors travel back by all_to_all and are assembled into [b, T, D] (row pieces scattered to
   their samples, a bag's partial sums added, column pieces concatenated);
replicated (data-parallel) tables are looked up and pooled locally. Backward runs the exchanges in
reverse; gradients are divided by the world size, matching DDP's averaging of the dense gradients,
so a step on N ranks equals a step of the plain collection (and `pool_bags`) on the global batch.
A shard the plan keeps in host memory is served by a `HostCache` (`ctrflow.embedding.host`), its
rows brought into the device cache in line, once the ids have reached their owner (step 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ctrflow.embedding.bags import bag_counts, check_slot_ids, is_bag, slot_columns, sort_bag_items
from ctrflow.embedding.cache import HostCache
from ctrflow.embedding.collection import table_rows
from ctrflow.embedding.comm import exchange, exchange_differentiable, group_size, replicated_lookup, scale_grad
from ctrflow.embedding.gather import gather_whole, gathered_on_main  # noqa: F401  (checkpoints import them here)
from ctrflow.embedding.host import HostTables
from ctrflow.embedding.plan import Shard, ShardingPlan
from ctrflow.embedding.pooling import pool_bags
from ctrflow.embedding.tables import TableConfig

Init = Callable[[TableConfig, int, Shard], torch.Tensor]  # (table, table index, shard) -> shard weights


class ShardedEmbeddingCollection(HostTables, nn.Module):
    """ids [b, S] -> [b, T, D] with tables placed by a `ShardingPlan`; one parameter per local shard.

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
        self.columns = slot_columns(self.tables)
        self.world_size = group_size(group)
        self.rank = dist.get_rank(group) if self.world_size > 1 else 0
        if plan.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks, process group has {self.world_size}")
        self.check, self.device = check, torch.device(device)
        self.weights = nn.ParameterDict()
        self.caches: dict[str, HostCache] = {}
        for i, t in enumerate(self.tables):
            shard = plan.tables[t.name].shard_on(self.rank)
            if shard is not None and shard.placement == "host":
                self.keep_on_host(t.name, HostCache(shard.num_rows, shard.num_cols, shard.cache_rows, device,
                                                    lambda store, t=t, i=i, s=shard: store.copy_(init(t, i, s))))
            elif shard is not None:
                self.weights[t.name] = nn.Parameter(init(t, i, shard).to(device))
        # per destination rank: the model-parallel shards it serves, in one order every rank agrees on
        self.served = [[(f, t.name, s) for f, t in enumerate(self.tables) if plan.tables[t.name].sharding != "data"
                        for s in plan.tables[t.name].shards if s.rank == r] for r in range(self.world_size)]
        self.replicated = [f for f, t in enumerate(self.tables) if plan.tables[t.name].sharding == "data"]
        self.flat = [x for served in self.served for x in served]  # dest-major, the send order
        self.row_slots: dict[int, list[tuple[int, Shard]]] = {}  # row-split table -> (flat index, shard)
        for i, (f, _name, s) in enumerate(self.flat):
            if s.num_rows != self.tables[f].num_embeddings:
                self.row_slots.setdefault(f, []).append((i, s))
        for slots in self.row_slots.values():
            slots.sort(key=lambda x: x[1].rows[0])
        self.row_starts = {f: torch.tensor([s.rows[0] for _, s in slots], device=self.device)
                           for f, slots in self.row_slots.items()}
        # row-split bags: their pieces' bag counts travel after each destination's id counts
        self.bag_rows = {f for f in self.row_slots if is_bag(self.tables[f])}
        self.count_width = [len(served) + sum(f in self.bag_rows for f, _, _ in served) for served in self.served]

    @classmethod
    def from_collection(cls, collection, plan: ShardingPlan, group=None, device="cpu", check: bool = True):
        """Shard a plain `EmbeddingCollection`, keeping its current weights (a deferred one's
        rows are drawn shard by shard: no process holds a whole table)."""

        def take(_t: TableConfig, i: int, s: Shard) -> torch.Tensor:
            return table_rows(collection, i, s.rows[0], s.rows[1])[:, s.cols[0]:s.cols[1]].clone()

        return cls(collection.tables, plan, take, group, device, check)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, S] of this rank's samples -> [b, T, D]; a collective (every rank calls it each step)."""
        if self.check:
            check_slot_ids(ids, self.tables)
        b = ids.shape[0]
        pieces = self._lookup_model_parallel(ids)
        if self.replicated:
            values = replicated_lookup([self._ids_of(ids, f) for f in self.replicated],
                                       [self.weights[self.tables[f].name] for f in self.replicated],
                                       self.group, float(self.world_size))
            for f, v in zip(self.replicated, values):
                pieces[f] = [(None, None, self._pool_whole(v, self._ids_of(ids, f), f))]
        columns = [self._assemble(pieces[f], b, ids, f) for f in range(len(self.tables))]
        return torch.stack(columns, dim=1)  # [b, T, D]

    def _ids_of(self, ids: torch.Tensor, f: int) -> torch.Tensor:
        """Table f's ids of every sample, flat ([b], or [b * length] sample-major for a bag)."""
        a, z = self.columns[f]
        return ids[:, a:z].reshape(-1) if is_bag(self.tables[f]) else ids[:, a]

    def _pool_whole(self, values: torch.Tensor, flat_ids: torch.Tensor, f: int) -> torch.Tensor:
        """Whole bags' vectors [n * length, d] (their ids `flat_ids`) -> [n, d] by `pool_bags`."""
        t = self.tables[f]
        if not is_bag(t):
            return values
        n = flat_ids.shape[0] // t.length
        return pool_bags(values.view(n, t.length, -1), flat_ids.view(n, t.length), [t]).squeeze(1)

    def _lookup_model_parallel(self, ids: torch.Tensor) -> list[list]:
        """Route ids to shard owners, look them up there, route vectors back (steps 1-4)."""
        if not self.flat:
            return [[] for _ in self.tables]
        counts, grouped = self._count(ids)
        per_dest = [len(served) for served in self.served]
        mine = self.count_width[self.rank]
        recv_counts = exchange(counts, [mine] * self.world_size, self.count_width, self.group)
        both = torch.cat([counts, recv_counts]).tolist()  # the step's one host sync: split sizes
        items, bags = self._parse_counts(both[:counts.numel()], range(self.world_size))
        recv_items, recv_bags = self._parse_counts(both[counts.numel():], [self.rank] * self.world_size, True)
        send, positions, ranks = self._pieces(ids, grouped, items, bags)
        recv_ids = exchange(torch.cat(send), [sum(c) for c in recv_items], _chunk_sums(items, per_dest), self.group)
        recv_ranks = self._exchange_ranks(ranks, items, recv_items) if self.bag_rows else None
        looked_up = self._lookup_local(recv_ids, recv_items, recv_bags, recv_ranks)
        dims_mine = [s.num_cols for _, _, s in self.served[self.rank]]
        back_out = [sum(c * d for c, d in zip(row, dims_mine)) for row in recv_bags]
        sizes = [c * s.num_cols for c, (_, _, s) in zip(bags, self.flat)]
        returned = exchange_differentiable(looked_up, _chunk_sums(sizes, per_dest), back_out, self.group)
        returned = scale_grad(returned, 1.0 / self.world_size)
        pieces: list[list] = [[] for _ in self.tables]
        for (f, _name, s), pos, chunk, c in zip(self.flat, positions, returned.split(sizes), bags):
            pieces[f].append((s, pos, chunk.view(c, s.num_cols)))
        return pieces

    def _count(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Ids per flat shard as one device tensor, destination by destination (then the bag counts
        of its row-split bags' pieces); row-split tables grouped by owning shard (one-hot: shard-local
        ids sorted by owner and the sample of each; bags: `BagItems`)."""
        b = ids.shape[0]
        counts: dict[int, torch.Tensor] = {}
        bag_counts_: dict[int, torch.Tensor] = {}
        grouped = {}
        for f, slots in self.row_slots.items():
            a, z = self.columns[f]
            starts = self.row_starts[f]
            if f in self.bag_rows:
                grouped[f] = g = sort_bag_items(ids[:, a:z], starts)
                for k, (i, _s) in enumerate(slots):
                    counts[i], bag_counts_[i] = g.items[k:k + 1], g.bags[k:k + 1]
                continue
            col = ids[:, a].contiguous()
            owner = torch.bucketize(col, starts[1:], right=True)  # [b] index into `slots`
            order = torch.argsort(owner, stable=True)
            grouped[f] = (col[order] - starts[owner[order]], order)
            per_shard = torch.bincount(owner, minlength=len(slots))
            for k, (i, _s) in enumerate(slots):
                counts[i] = per_shard[k:k + 1]
        parts, start = [], 0
        for served in self.served:
            indices = range(start, start + len(served))
            parts += [counts.get(i) if i in counts else
                      torch.full((1,), b * self.tables[self.flat[i][0]].length, dtype=torch.int64, device=ids.device)
                      for i in indices]
            parts += [bag_counts_[i] for i in indices if i in bag_counts_]
            start += len(served)
        return torch.cat(parts), grouped

    def _parse_counts(self, values: list[int], dests, by_source: bool = False) -> tuple[list, list]:
        """Split exchanged counts into ids and vectors (bags) per shard: flat lists for `dests`
        0..W-1 (what this rank sends), or per source lists of this rank's shards (`by_source`)."""
        items, bags, start = [], [], 0
        for d in dests:
            served, width = self.served[d], self.count_width[d]
            block, start = values[start:start + width], start + width
            extra = iter(block[len(served):])
            row_items = block[:len(served)]
            row_bags = [next(extra) if f in self.bag_rows else c // self.tables[f].length
                        for (f, _name, _s), c in zip(served, row_items)]
            if by_source:
                items.append(row_items)
                bags.append(row_bags)
            else:
                items += row_items
                bags += row_bags
        return items, bags

    def _pieces(self, ids: torch.Tensor, grouped: dict, counts: list[int], bags: list[int]
                ) -> tuple[list, list, dict]:
        """Per flat shard: the ids to send, the sample positions its vectors fill (None: all samples)
        and, for row-split bags, each id's bag number in its piece."""
        send: list = [None] * len(self.flat)
        positions: list = [None] * len(self.flat)
        ranks: dict[int, torch.Tensor] = {}
        for f, slots in self.row_slots.items():
            sizes = [counts[i] for i, _ in slots]
            if f in self.bag_rows:
                g, n = grouped[f], sum(sizes)
                rest = g.ids.shape[0] - n
                spans = [bags[i] for i, _ in slots]
                parts = zip(g.ids.split(sizes + [rest]), g.ranks.split(sizes + [rest]),
                            g.samples.split(spans + [g.samples.shape[0] - sum(spans)]))
                for (i, _s), (part, rank, pos) in zip(slots, parts):
                    send[i], positions[i], ranks[i] = part, pos, rank
                continue
            local, order = grouped[f]
            for (i, _s), part, pos in zip(slots, local.split(sizes), order.split(sizes)):
                send[i], positions[i] = part, pos
        for i, (f, _name, _s) in enumerate(self.flat):
            if send[i] is None:
                send[i] = self._ids_of(ids, f)
        return send, positions, ranks

    def _exchange_ranks(self, ranks: dict, counts: list[int], recv_items: list[list[int]]) -> torch.Tensor:
        """The bag numbers of the row-split bags' ids, to their owners (one more all_to_all)."""
        sent, start = [], 0
        for served in self.served:
            sent.append(sum(counts[i] for i in range(start, start + len(served)) if i in ranks))
            start += len(served)
        mine = [j for j, (f, _n, _s) in enumerate(self.served[self.rank]) if f in self.bag_rows]
        received = [sum(row[j] for j in mine) for row in recv_items]
        flat = torch.cat([ranks[i] for i in sorted(ranks)])  # flat order: destination-major, as the ids went
        return exchange(flat, received, sent, self.group)

    def _lookup_local(self, recv_ids: torch.Tensor, recv_items: list[list[int]], recv_bags: list[list[int]],
                      recv_ranks: torch.Tensor | None) -> torch.Tensor:
        """Look up the ids every source sent to this rank's shards and pool their bags; flat,
        source-major, shard-minor."""
        served = self.served[self.rank]
        if not served:
            return torch.zeros(0, device=recv_ids.device, requires_grad=True)
        chunks = recv_ids.split([c for row in recv_items for c in row])
        k = len(served)
        bag_pieces = [j for j, (f, _n, _s) in enumerate(served) if f in self.bag_rows]
        rank_chunks = (recv_ranks.split([row[j] for row in recv_items for j in bag_pieces])
                       if recv_ranks is not None else ())
        per_source: list[list[torch.Tensor]] = [[] for _ in recv_items]
        for j, (f, name, _s) in enumerate(served):
            shard_ids = torch.cat([chunks[src * k + j] for src in range(len(recv_items))])
            emb = self.lookup(name, shard_ids)  # [n, d_shard]
            if f in self.bag_rows:  # partial sums: each id into its bag, bags numbered per source
                p, first, into = bag_pieces.index(j), 0, []
                for src, row in enumerate(recv_bags):
                    into.append(rank_chunks[src * len(bag_pieces) + p] + first)
                    first += row[j]
                emb = emb.new_zeros(first, emb.shape[1]).index_add(0, torch.cat(into), emb)
            else:
                emb = self._pool_whole(emb, shard_ids, f)
            for src, part in enumerate(emb.split([row[j] for row in recv_bags])):
                per_source[src].append(part.reshape(-1))
        return torch.cat([p for parts in per_source for p in parts])

    def _assemble(self, pieces: list, b: int, ids: torch.Tensor, f: int) -> torch.Tensor:
        """One table's [b, D] from its pieces: whole, row pieces scattered (a bag's partial sums
        added, a mean divided by its count), or column pieces joined."""
        if len(pieces) == 1 and pieces[0][1] is None and pieces[0][2].shape[1] == self.embedding_dim:
            return pieces[0][2]
        if pieces[0][1] is not None:  # row-wise
            pos = torch.cat([p for _, p, _ in pieces])
            values = torch.cat([v for _, _, v in pieces])
            if f not in self.bag_rows:
                return values.new_zeros(b, self.embedding_dim).index_copy(0, pos, values)
            bag = values.new_zeros(b, self.embedding_dim).index_add(0, pos, values)
            if self.tables[f].pooling == "mean":
                a, z = self.columns[f]
                bag = bag / bag_counts(ids[:, a:z]).to(bag.dtype).unsqueeze(1)
            return bag
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
        return self.gather_table(name, self.local_rows(name) if name in self.weights else None)

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
                self.load_local_rows(t.name, part)

    def reduce_row_sums(self, name: str, partial: torch.Tensor) -> torch.Tensor:
        """Sum per-row partial sums over the column shards of a table (identity unless column-wise)."""
        if self.plan.tables[name].sharding != "column" or self.world_size == 1:
            return partial
        total = partial.clone()
        dist.all_reduce(total, group=self.group)
        return total


def _chunk_sums(values: list[int], chunk_lengths: list[int]) -> list[int]:
    sums, start = [], 0
    for n in chunk_lengths:
        sums.append(sum(values[start:start + n]))
        start += n
    return sums
