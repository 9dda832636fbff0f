"""Where every id of a hybrid-parallel step goes, for the fused sharded collection.

`Layout` is computed from the plan, the same on every rank. `route` builds one step's exchange:
what rank r sends to rank d is, in this order,
    ids[:, tab[d]] as [b, len(tab[d])] (sample-major: the ids of the tables d holds whole),
    then one piece per row-wise shard d holds (the ids in its row range, made shard-local);
so what a rank receives from each source is its local shards' ids in a fixed order, and one fused
lookup of all of them (each id plus its local table's offset in the one buffer) returns the
embeddings in exactly the order they go back. Table-wise plans have static split sizes (no host
sync); row-wise shards need their counts exchanged first (one device-to-host read per step).
Static plans can route the next step's ids during this step (`start_route` / `finish_route`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctrflow.embedding.comm import exchange, exchange_async
from ctrflow.embedding.plan import ShardingPlan
from ctrflow.embedding.tables import TableConfig


class Layout:
    """Per rank of the plan: the features it holds whole (`tab`), the row-wise shards it holds
    (`row_slots`: (feature, shard)), and the replicated features (`rep`); this rank's local tables
    (its whole tables first, then its row pieces) for one fused buffer."""

    def __init__(self, tables: list[TableConfig], plan: ShardingPlan, rank: int):
        world = plan.world_size
        kinds = [plan.tables[t.name].sharding for t in tables]
        column = [t.name for t, k in zip(tables, kinds) if k == "column"]
        if column:
            raise ValueError(f"the fused sharded path has no column-wise sharding (tables {', '.join(column)})")
        self.world, self.rank = world, rank
        self.tab = [[f for f, t in enumerate(tables) if kinds[f] == "table" and plan.tables[t.name].shards[0].rank == d]
                    for d in range(world)]
        self.row_feats = [f for f, k in enumerate(kinds) if k == "row"]
        self.row_shards = {f: sorted(plan.tables[tables[f].name].shards, key=lambda s: s.rows[0])
                           for f in self.row_feats}
        self.row_slots = [[(f, s) for f in self.row_feats for s in self.row_shards[f] if s.rank == d]
                          for d in range(world)]
        self.rep = [f for f, k in enumerate(kinds) if k == "data"]
        self.local_tables = [tables[f] for f in self.tab[rank]] + [
            TableConfig(f"{tables[f].name}[{s.rows[0]}:{s.rows[1]}]", s.num_rows, tables[f].embedding_dim,
                        tables[f].feature) for f, s in self.row_slots[rank]]
        # for each local table: (table name, the rows of the whole table it holds)
        self.local_parts = [(tables[f].name, (0, tables[f].num_embeddings)) for f in self.tab[rank]] + [
            (tables[f].name, s.rows) for f, s in self.row_slots[rank]]

    @property
    def static(self) -> bool:
        """Whether split sizes follow from the batch size alone (no row-wise shards)."""
        return not self.row_feats


@dataclass
class Route:
    """One step's exchange: `rows` [N] the ids received, as rows of the local fused buffer; split
    sizes in items (`send[d]` to rank d, `recv[s]` from rank s); `row_orders[f]` the sample order
    of row-wise feature f's pieces and `row_counts[d]` the pieces' sizes sent to d."""

    batch: int
    rows: torch.Tensor
    send: list[int]
    recv: list[int]
    row_orders: dict[int, torch.Tensor]
    row_counts: list[list[int]]


def route(ids: torch.Tensor, layout: Layout, local_offsets: torch.Tensor | None, group, cache: dict,
          tab_index: list[torch.Tensor]) -> Route:
    """Send every id to the rank serving it (an all-to-all) and number what arrives as local rows;
    `tab_index[d]` is `layout.tab[d]` as a device tensor."""
    b = ids.shape[0]
    orders, sorted_ids, counts_dev = _sort_row_features(ids, layout, cache)
    row_counts, recv_counts = _exchange_counts(counts_dev, layout, group)
    pieces = split_pieces(sorted_ids, layout, row_counts)
    send_ids = []
    for d in range(layout.world):
        if layout.tab[d]:
            send_ids.append(ids.index_select(1, tab_index[d]).reshape(-1))
        send_ids.extend(pieces[d])
    send = [b * len(layout.tab[d]) + sum(row_counts[d]) for d in range(layout.world)]
    mine = len(layout.tab[layout.rank])
    recv = [b * mine + sum(c) for c in recv_counts]
    flat = torch.cat(send_ids) if send_ids else ids.new_empty(0)
    got = exchange(flat, recv, send, group)
    if local_offsets is None:
        return Route(b, got, send, recv, orders, row_counts)
    offsets = _item_offsets(b, mine, local_offsets, recv_counts, layout.static, cache)
    return Route(b, got + offsets, send, recv, orders, row_counts)


def start_route(ids: torch.Tensor, layout: Layout, group, tab_index: list[torch.Tensor]) -> tuple:
    """`route`'s ids all-to-all for a static layout (no row-wise shards: sizes follow from the
    batch size), started asynchronously: (route whose `rows` are the received ids, its work or None);
    `finish_route` makes them local rows."""
    b = ids.shape[0]
    parts = [ids.index_select(1, tab_index[d]).reshape(-1) for d in range(layout.world) if layout.tab[d]]
    send = [b * len(layout.tab[d]) for d in range(layout.world)]
    recv = [b * len(layout.tab[layout.rank])] * layout.world
    flat = torch.cat(parts) if parts else ids.new_empty(0)
    got, work = exchange_async(flat, recv, send, group)
    return Route(b, got, send, recv, {}, [[] for _ in range(layout.world)]), work


def finish_route(r: Route, work, layout: Layout, local_offsets: torch.Tensor | None, cache: dict,
                 out: torch.Tensor) -> Route:
    """`start_route`'s route once its exchange is waited for, with local rows written into `out`."""
    if work is not None:
        work.wait()
    if local_offsets is None:  # this rank holds no shard: nothing arrives
        return r
    mine = len(layout.tab[layout.rank])
    offsets = _item_offsets(r.batch, mine, local_offsets, [[] for _ in range(layout.world)], True, cache)
    torch.add(r.rows, offsets, out=out)
    return Route(r.batch, out, r.send, r.recv, r.row_orders, r.row_counts)


def _sort_row_features(ids: torch.Tensor, layout: Layout, cache: dict) -> tuple[dict, dict, torch.Tensor | None]:
    """Per row-wise feature: its samples ordered by owning shard, and their shard-local ids in that
    order; the number of ids per (destination, row slot) as one device tensor, destination-major."""
    orders, sorted_ids, sizes = {}, {}, {}
    for f in layout.row_feats:
        shards = layout.row_shards[f]
        col = ids[:, f].contiguous()
        if ("starts", f) not in cache:
            cache["starts", f] = torch.tensor([s.rows[0] for s in shards], device=ids.device)
        starts = cache["starts", f]
        owner = torch.bucketize(col, starts[1:], right=True)  # [b] index into `shards`
        order = torch.argsort(owner, stable=True)
        orders[f] = order
        sorted_ids[f] = col[order] - starts[owner[order]]
        sizes[f] = torch.bincount(owner, minlength=len(shards))
    if not layout.row_feats:
        return orders, sorted_ids, None
    counts = [sizes[f][layout.row_shards[f].index(s)].view(1)
              for d in range(layout.world) for f, s in layout.row_slots[d]]
    return orders, sorted_ids, torch.cat(counts)


def split_pieces(sorted_values: dict, layout: Layout, row_counts: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per destination, the pieces (in its `row_slots` order) of each row feature's values ordered by
    owning shard (ids in forward, gradient rows in backward)."""
    sizes = {f: [0] * len(layout.row_shards[f]) for f in layout.row_feats}
    for d in range(layout.world):
        for (f, s), c in zip(layout.row_slots[d], row_counts[d]):
            sizes[f][layout.row_shards[f].index(s)] = c
    split = {f: v.split(sizes[f]) for f, v in sorted_values.items()}
    return [[split[f][layout.row_shards[f].index(s)] for f, s in layout.row_slots[d]] for d in range(layout.world)]


def _exchange_counts(counts_dev, layout: Layout, group) -> tuple[list[list[int]], list[list[int]]]:
    """Piece sizes sent to each rank and received from each (the step's one host sync)."""
    if counts_dev is None:
        return [[] for _ in range(layout.world)], [[] for _ in range(layout.world)]
    per_dest = [len(slots) for slots in layout.row_slots]
    mine = per_dest[layout.rank]
    got = exchange(counts_dev, [mine] * layout.world, per_dest, group)
    both = torch.cat([counts_dev, got]).tolist()
    sent, received, start = [], [], 0
    for n in per_dest:
        sent.append(both[start:start + n])
        start += n
    for _ in range(layout.world):
        received.append(both[start:start + mine])
        start += mine
    return sent, received


def _item_offsets(b: int, mine: int, offsets: torch.Tensor, recv_counts: list[list[int]], static: bool,
                  cache: dict) -> torch.Tensor:
    """[N] the local buffer offset of every received item: its local table's first row."""
    key = ("offsets", b)
    if static and key in cache:
        return cache[key]
    tab = offsets[:mine].repeat(b)  # [b * mine], sample-major like the ids
    parts = []
    for counts in recv_counts:
        parts.append(tab)
        if counts:
            sizes = torch.tensor(counts, device=offsets.device)
            parts.append(torch.repeat_interleave(offsets[mine:], sizes, output_size=sum(counts)))
    out = torch.cat(parts) if parts else offsets.new_empty(0)
    if static:
        cache[key] = out
    return out


def place_index(layout: Layout, r: Route, features: int, n_back: int, device, cache: dict) -> torch.Tensor:
    """[b, F]: for each (sample, feature) its row in the forward's source buffer, which holds the
    returned embeddings (in the order the ids were sent), then the replicated lookups [b, n_rep]."""
    key = ("place", r.batch)
    if layout.static and key in cache:
        return cache[key]
    b = r.batch
    at = torch.arange(b, device=device)
    perm = torch.empty(b, features, dtype=torch.int64, device=device)
    start, row_src = 0, {f: [] for f in layout.row_feats}
    for d in range(layout.world):
        n = len(layout.tab[d])
        for k, f in enumerate(layout.tab[d]):
            perm[:, f] = start + at * n + k
        start += b * n
        for (f, s), c in zip(layout.row_slots[d], r.row_counts[d]):
            row_src[f].append((layout.row_shards[f].index(s), start, c))
            start += c
    for k, f in enumerate(layout.rep):
        perm[:, f] = n_back + at * len(layout.rep) + k
    for f, pieces in row_src.items():  # sorted position j of shard k's piece -> its source row
        pieces.sort()
        shifts, done = [], 0
        for _k, piece_start, c in pieces:
            shifts.append(piece_start - done)
            done += c
        sizes = torch.tensor([c for _, _, c in pieces], device=device)
        shift = torch.repeat_interleave(torch.tensor(shifts, device=device), sizes, output_size=b)
        perm[r.row_orders[f], f] = at + shift
    if layout.static:
        cache[key] = perm
    return perm


def pack_index(layout: Layout, r: Route, features: int, device, cache: dict) -> torch.Tensor:
    """[items sent + b * n_rep]: the gradient row (sample * F + feature) of each item in the order
    the ids were sent, then the replicated features' rows."""
    key = ("pack", r.batch)
    if layout.static and key in cache:
        return cache[key]
    b = r.batch
    at = torch.arange(b, device=device).unsqueeze(1) * features
    parts = []
    for d in range(layout.world):
        if layout.tab[d]:
            parts.append((at + torch.tensor(layout.tab[d], device=device)).reshape(-1))
        for f, s in layout.row_slots[d]:
            k, sizes = layout.row_shards[f].index(s), _shard_sizes(layout, r, f)
            begin = sum(sizes[:k])
            parts.append(r.row_orders[f][begin:begin + sizes[k]] * features + f)
    if layout.rep:
        parts.append((at + torch.tensor(layout.rep, device=device)).reshape(-1))
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    if layout.static:
        cache[key] = index
    return index


def _shard_sizes(layout: Layout, r: Route, f: int) -> list[int]:
    """Ids per shard of row-wise feature f in this step (the sizes sent to each owner)."""
    sizes = [0] * len(layout.row_shards[f])
    for d in range(layout.world):
        for (g, s), c in zip(layout.row_slots[d], r.row_counts[d]):
            if g == f:
                sizes[layout.row_shards[f].index(s)] = c
    return sizes
