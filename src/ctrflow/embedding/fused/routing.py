"""Where every id of a hybrid-parallel step goes, for the fused sharded collection.

`Layout` (`layout.py`) is computed from the plan, the same on every rank. `route` builds one step's
exchange: what rank r sends to rank d is, in this order,
    ids[:, tab_cols[d]] as [b, columns] (sample-major: the ids of the tables d holds whole, a bag's
    `length` ids each),
    then one piece per row-wise shard d holds (the ids in its row range, made shard-local; a bag's
    without padding, their bag numbers following in a second exchange);
so what a rank receives from each source is its local shards' ids in a fixed order, and one fused
lookup of all of them (each id plus its local table's offset in the one buffer) returns the
rows in exactly the order they go back, bags pooled on the way (`owner_pool.py`): one vector per
(sample, whole table) and per row piece's bag. Table-wise plans have static split sizes (no host
sync; bags too: sizes follow from b and the lengths); row-wise shards need their counts exchanged
first (one device-to-host read per step). Static plans can route the next step's ids during this
step (`start_route` / `finish_route`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctrflow.embedding.bags import BagItems, sort_bag_items
from ctrflow.embedding.comm import exchange, exchange_async
from ctrflow.embedding.fused.layout import Layout
from ctrflow.embedding.fused.owner_pool import OwnerPool, owner_pool

__all__ = ["Layout", "Route", "finish_route", "route", "start_route"]


@dataclass
class Route:
    """One step's exchange: `rows` [N] the ids received, as rows of the local fused buffer; split
    sizes of the ids' all-to-all (`send[d]` ids to rank d, `recv[s]` from rank s) and of the
    vectors' (`back_in[d]` vectors back from rank d, `back_out[s]` returned to rank s: one per id
    without bags); `row_orders[f]` the sample order of one-hot row-wise table f's pieces,
    `row_counts[d]` / `row_bags[d]` the ids / vectors of the pieces sent to d, `bag_samples[f]` the
    sample of each partial sum of row-split bag f (shard by shard); `pool`: how this rank pools
    what it received (None: one vector per id, or `layout.owner_bags`); `ids`: the received ids
    before local offsets (what the bag kernels read with `layout.owner_bags`)."""

    batch: int
    rows: torch.Tensor
    send: list[int]
    recv: list[int]
    row_orders: dict[int, torch.Tensor]
    row_counts: list[list[int]]
    back_in: list[int]
    back_out: list[int]
    row_bags: list[list[int]]
    bag_samples: dict[int, torch.Tensor] = field(default_factory=dict)
    pool: OwnerPool | None = None
    ids: torch.Tensor | None = None


def empty_route(b: int, ids: torch.Tensor, world: int) -> Route:
    """The route of a plan with no model-parallel table: nothing travels."""
    zeros, nothing = [0] * world, [[] for _ in range(world)]
    return Route(b, ids.new_empty(0), zeros, zeros, {}, nothing, zeros, zeros, nothing)


def route(ids: torch.Tensor, layout: Layout, local_offsets: torch.Tensor | None, group, cache: dict,
          tab_index: list[torch.Tensor]) -> Route:
    """Send every id to the rank serving it (an all-to-all) and number what arrives as local rows;
    `tab_index[d]` is `layout.tab_cols[d]` as a device tensor."""
    b, world = ids.shape[0], layout.world
    orders, sorted_ids, bag_items, counts_dev = _sort_row_features(ids, layout, cache)
    row_counts, row_bags, recv_counts, recv_bags = _exchange_counts(counts_dev, layout, group)
    pieces = split_pieces(sorted_ids, layout, row_counts)
    send_ids = []
    for d in range(world):
        if layout.tab[d]:
            send_ids.append(ids.index_select(1, tab_index[d]).reshape(-1))
        send_ids.extend(pieces[d])
    send = [b * len(layout.tab_cols[d]) + sum(row_counts[d]) for d in range(world)]
    mine = len(layout.tab_cols[layout.rank])
    recv = [b * mine + sum(c) for c in recv_counts]
    flat = torch.cat(send_ids) if send_ids else ids.new_empty(0)
    got = exchange(flat, recv, send, group)
    ranks = _exchange_ranks(bag_items, layout, row_counts, recv_counts, group) if layout.bag_rows else None
    back_in = [b * len(layout.tab[d]) + sum(row_bags[d]) for d in range(world)]
    back_out = [b * len(layout.tab[layout.rank]) + sum(n) for n in recv_bags]
    samples = {f: g.samples for f, g in bag_items.items()}
    r = Route(b, got, send, recv, orders, row_counts, back_in, back_out, row_bags, samples, ids=got)
    if local_offsets is None:  # this rank holds no shard: nothing arrives
        return r
    pools = layout.pools and not layout.owner_bags
    r.pool = owner_pool(got, b, layout, recv_counts, recv_bags, ranks, cache) if pools else None
    r.rows = got + _item_offsets(b, layout, local_offsets, recv_counts, cache)
    return r


def start_route(ids: torch.Tensor, layout: Layout, group, tab_index: list[torch.Tensor]) -> tuple:
    """`route`'s ids all-to-all for a static layout (no row-wise shards: sizes follow from the
    batch size), started asynchronously: (route whose `rows` are the received ids, its work or None);
    `finish_route` makes them local rows."""
    b, world = ids.shape[0], layout.world
    parts = [ids.index_select(1, tab_index[d]).reshape(-1) for d in range(world) if layout.tab[d]]
    send = [b * len(layout.tab_cols[d]) for d in range(world)]
    recv = [b * len(layout.tab_cols[layout.rank])] * world
    flat = torch.cat(parts) if parts else ids.new_empty(0)
    got, work = exchange_async(flat, recv, send, group)
    nothing = [[] for _ in range(world)]
    back_in = [b * len(layout.tab[d]) for d in range(world)]
    back_out = [b * len(layout.tab[layout.rank])] * world
    return Route(b, got, send, recv, {}, nothing, back_in, back_out, nothing), work


def finish_route(r: Route, work, layout: Layout, local_offsets: torch.Tensor | None, cache: dict,
                 out: torch.Tensor) -> Route:
    """`start_route`'s route once its exchange is waited for, with local rows written into `out`."""
    if work is not None:
        work.wait()
    if local_offsets is None:  # this rank holds no shard: nothing arrives
        return r
    nothing = [[] for _ in range(layout.world)]
    pool = ids = None
    # into buffers kept from step to step, like `out`: a captured step reads them there
    if layout.owner_bags:
        key = ("ahead ids", r.rows.numel())
        ids = cache[key] = cache[key].copy_(r.rows) if key in cache else r.rows.clone()
    elif layout.pools:
        key = ("ahead pool", r.rows.numel())
        pool = cache[key] = owner_pool(r.rows, r.batch, layout, nothing, nothing, None, cache, cache.get(key))
    torch.add(r.rows, _item_offsets(r.batch, layout, local_offsets, nothing, cache), out=out)
    return Route(r.batch, out, r.send, r.recv, r.row_orders, r.row_counts, r.back_in, r.back_out, r.row_bags,
                 r.bag_samples, pool, ids)


def _sort_row_features(ids: torch.Tensor, layout: Layout, cache: dict) -> tuple:
    """Per row-wise table: its ids ordered by owning shard, made shard-local (one-hot: with the
    sample order; a bag: `BagItems`); the ids per (destination, row slot), then each destination's
    bag pieces' vector counts, as one device tensor, destination-major."""
    orders, sorted_ids, bag_items, sizes, bags = {}, {}, {}, {}, {}
    for f in layout.row_feats:
        shards = layout.row_shards[f]
        a, z = layout.columns[f]
        if ("starts", f) not in cache:
            cache["starts", f] = torch.tensor([s.rows[0] for s in shards], device=ids.device)
        starts = cache["starts", f]
        if f in layout.bag_rows:
            g = bag_items[f] = sort_bag_items(ids[:, a:z], starts)
            sorted_ids[f], sizes[f], bags[f] = g.ids, g.items, g.bags
            continue
        col = ids[:, a].contiguous()
        owner = torch.bucketize(col, starts[1:], right=True)  # [b] index into `shards`
        order = torch.argsort(owner, stable=True)
        orders[f] = order
        sorted_ids[f] = col[order] - starts[owner[order]]
        sizes[f] = torch.bincount(owner, minlength=len(shards))
    if not layout.row_feats:
        return orders, sorted_ids, bag_items, None
    counts = []
    for d in range(layout.world):
        counts += [sizes[f][layout.row_shards[f].index(s)].view(1) for f, s in layout.row_slots[d]]
        counts += [bags[f][layout.row_shards[f].index(s)].view(1) for f, s in layout.row_slots[d] if f in bags]
    return orders, sorted_ids, bag_items, torch.cat(counts)


def split_pieces(sorted_values: dict, layout: Layout, row_counts: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per destination, the pieces (in its `row_slots` order) of each row table's ids ordered by
    owning shard (a bag's dropped padding, sorted last, left out; None for tables not in `sorted_values`)."""
    sizes = {f: [0] * len(layout.row_shards[f]) for f in layout.row_feats}
    for d in range(layout.world):
        for (f, s), c in zip(layout.row_slots[d], row_counts[d]):
            sizes[f][layout.row_shards[f].index(s)] = c
    split = {f: v[:sum(sizes[f])].split(sizes[f]) for f, v in sorted_values.items()}
    return [[split[f][layout.row_shards[f].index(s)] if f in split else None for f, s in layout.row_slots[d]]
            for d in range(layout.world)]


def _exchange_counts(counts_dev, layout: Layout, group) -> tuple[list, list, list, list]:
    """Ids and vectors per row piece sent to each rank and received from each (the step's one host
    sync): (ids sent, vectors sent, ids received, vectors received); a one-hot piece's are equal."""
    nothing = [[] for _ in range(layout.world)]
    if counts_dev is None:
        return nothing, nothing, nothing, nothing
    widths = [len(slots) + sum(f in layout.bag_rows for f, _ in slots) for slots in layout.row_slots]
    got = exchange(counts_dev, [widths[layout.rank]] * layout.world, widths, group)
    values = iter(torch.cat([counts_dev, got]).tolist())
    parsed = []  # per destination, then per source (this rank's pieces): (ids, vectors) per piece
    for d in [*range(layout.world), *[layout.rank] * layout.world]:
        slots = layout.row_slots[d]
        items = [next(values) for _ in slots]
        parsed.append((items, [next(values) if f in layout.bag_rows else c for (f, _s), c in zip(slots, items)]))
    sent, received = parsed[:layout.world], parsed[layout.world:]
    return [p[0] for p in sent], [p[1] for p in sent], [p[0] for p in received], [p[1] for p in received]


def _exchange_ranks(bag_items: dict[int, BagItems], layout: Layout, row_counts: list[list[int]],
                    recv_counts: list[list[int]], group) -> torch.Tensor:
    """The bag numbers of the row-split bags' ids, to their owners, in the order the ids went."""
    ranks = split_pieces({f: g.ranks for f, g in bag_items.items()}, layout, row_counts)
    parts, sent = [], []
    for d in range(layout.world):
        mine = [p for (f, _s), p in zip(layout.row_slots[d], ranks[d]) if f in layout.bag_rows]
        parts += mine
        sent.append(sum(p.numel() for p in mine))
    pieces = layout.row_slots[layout.rank]
    received = [sum(c for (f, _s), c in zip(pieces, counts) if f in layout.bag_rows) for counts in recv_counts]
    return exchange(torch.cat(parts), received, sent, group)


def _item_offsets(b: int, layout: Layout, offsets: torch.Tensor, recv_counts: list[list[int]],
                  cache: dict) -> torch.Tensor:
    """[N] the local buffer offset of every received id: its local table's first row."""
    key = ("offsets", b)
    if layout.static and key in cache:
        return cache[key]
    tabs = len(layout.tab[layout.rank])
    if layout.one_hot or len(layout.tab_slot_table) == tabs:
        tab = offsets[:tabs].repeat(b)  # [b * tables], sample-major like the ids
    else:  # [b * columns]: a bag's offset once per slot
        slot_table = torch.tensor(layout.tab_slot_table, dtype=torch.int64, device=offsets.device)
        tab = offsets[:tabs].index_select(0, slot_table).repeat(b)
    parts = []
    for counts in recv_counts:
        parts.append(tab)
        if counts:
            sizes = torch.tensor(counts, device=offsets.device)
            parts.append(torch.repeat_interleave(offsets[tabs:], sizes, output_size=sum(counts)))
    out = torch.cat(parts) if parts else offsets.new_empty(0)
    if layout.static:
        cache[key] = out
    return out
