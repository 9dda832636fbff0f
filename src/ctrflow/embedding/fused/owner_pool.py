"""Bags pooled where their rows live, on the fused sharded path (`ctrflow.embedding.bags` says why),
for plans with row-wise pieces (a static plan's owners pool with the bag kernels: `Layout.owner_bags`).

An owner receives, from each source, its whole tables' ids as [b, columns] (a bag's `length` ids
per sample, padding included) and then its row pieces' ids (a row-split bag's without padding, with
their bag numbers). `OwnerPool` maps every received id to the vector it adds into, in the order the
vectors go back: per source, [b, whole tables] then each row piece's bags (a one-hot id is its own
vector; padding adds into a sink past the last). Forward sums the looked-up rows (fp32) into those
vectors (a whole mean bag divided by its count); backward spreads each vector's gradient back over
its ids for the update (padding's: zero). No host sync: a static layout's map is cached per batch
size, and only where the padding is is read off each step's ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctrflow.embedding.fused.layout import Layout
from ctrflow.contract.features import PADDING_ID


@dataclass
class OwnerPool:
    """One step's pooling of the ids an owner received (module doc)."""

    index: torch.Tensor  # [N] the returned vector each received id adds into (a bag's padding: V, a sink)
    div: torch.Tensor  # [V] fp32: a whole mean bag's non-padding count (at least 1), else 1

    def pool(self, values: torch.Tensor) -> torch.Tensor:
        """Looked-up rows [N, D] -> the vectors to send back [V, D] (fp32)."""
        n = self.div.shape[0]
        out = torch.zeros(n + 1, values.shape[1], dtype=torch.float32, device=values.device)
        out.index_add_(0, self.index, values.float())
        return out[:n] / self.div.unsqueeze(1)

    def spread(self, grad: torch.Tensor) -> torch.Tensor:
        """Gradients of the returned vectors [V, D] -> of the received ids [N, D] (fp32; padding 0)."""
        scaled = torch.cat([grad.float() / self.div.unsqueeze(1), grad.new_zeros(1, grad.shape[1], dtype=torch.float32)])
        return scaled.index_select(0, self.index)


def owner_pool(got: torch.Tensor, b: int, layout: Layout, recv_counts: list[list[int]],
               recv_bags: list[list[int]], ranks: torch.Tensor | None, cache: dict,
               into: OwnerPool | None = None) -> OwnerPool:
    """The pooling of the ids `got` (as received, before local offsets) from every source's batch of
    b samples; `recv_counts[s][j]` / `recv_bags[s][j]`: ids and vectors of row piece j from source s;
    `ranks`: the bag numbers of the row-split bags' ids, in the order they arrived. `into`: a pool
    of the same sizes whose tensors are overwritten instead (a CUDA graph reads them where they are)."""
    device = got.device
    slots, tabs = len(layout.tab_slot_table), len(layout.tab_mean)
    whole = _whole_tables(b, layout, device, cache)
    if layout.static:
        key = ("pool", b)
        if key not in cache:
            world = layout.world
            cache[key] = (torch.cat([whole[0] + s * b * tabs for s in range(world)]) if world > 1 else whole[0],
                          whole[1].repeat(world), whole[2].repeat(world))
        index, bag_slot, mean = cache[key]
        return _finish(index, bag_slot & (got == PADDING_ID), mean, into)
    pieces = layout.row_slots[layout.rank]
    index, padding, mean, rank_parts = [], [], [], iter(ranks.split(_rank_sizes(layout, recv_counts))
                                                       if ranks is not None else ())
    item = vec = 0
    for counts, bags in zip(recv_counts, recv_bags):
        tab = got[item:item + b * slots]
        index.append(whole[0] + vec)
        padding.append(whole[1] & (tab == PADDING_ID))
        mean.append(whole[2])
        item, vec = item + b * slots, vec + b * tabs
        for (f, _s), c, n in zip(pieces, counts, bags):
            index.append(next(rank_parts) + vec if f in layout.bag_rows else
                         torch.arange(vec, vec + c, device=device))
            padding.append(torch.zeros(c, dtype=torch.bool, device=device))
            mean.append(torch.zeros(n, dtype=torch.bool, device=device))  # a partial sum: the requester divides
            item, vec = item + c, vec + n
    return _finish(torch.cat(index), torch.cat(padding), torch.cat(mean), into)


def _whole_tables(b: int, layout: Layout, device, cache: dict) -> tuple:
    """For one source's whole-table ids [b, columns]: (the vector of each id, whether it is a bag's
    slot, whether each of the b * tables vectors is a mean bag), cached per batch size."""
    key = ("whole", b)
    if key not in cache:
        tabs = len(layout.tab_mean)
        slot_table = torch.tensor(layout.tab_slot_table, dtype=torch.int64, device=device)
        at = torch.arange(b, device=device).unsqueeze(1) * tabs
        cache[key] = ((at + slot_table).reshape(-1),
                      torch.tensor(layout.tab_bag_slot, dtype=torch.bool, device=device).repeat(b),
                      torch.tensor(layout.tab_mean, dtype=torch.bool, device=device).repeat(b))
    return cache[key]


def _rank_sizes(layout: Layout, recv_counts: list[list[int]]) -> list[int]:
    """Per (source, row-split bag piece), in arrival order: how many bag numbers came."""
    pieces = layout.row_slots[layout.rank]
    return [c for counts in recv_counts for (f, _s), c in zip(pieces, counts) if f in layout.bag_rows]


def _finish(index: torch.Tensor, padding: torch.Tensor, mean: torch.Tensor, into: OwnerPool | None) -> OwnerPool:
    """The pool of ids adding into `index` (where not `padding`) of vectors that are means or sums."""
    n = mean.shape[0]
    index = torch.where(padding, n, index)  # padding adds into the sink, past the last vector
    count = torch.zeros(n + 1, dtype=torch.float32, device=index.device)
    count.index_add_(0, index, torch.ones(index.shape[0], dtype=torch.float32, device=index.device))
    div = torch.where(mean, count[:n].clamp_min(1), torch.ones_like(count[:n]))
    if into is None:
        return OwnerPool(index, div)
    into.index.copy_(index)
    into.div.copy_(div)
    return into
