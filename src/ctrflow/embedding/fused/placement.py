"""The requester's side of a fused sharded step: where each returned vector goes in [b, T, D]
(`place_index`, and `add_row_bags` for a row-split bag's partial sums) and where each gradient row
comes from on the way back (`pack_index`). Static layouts cache their indices per batch size."""

from __future__ import annotations

import torch

from ctrflow.embedding.bags import bag_counts
from ctrflow.embedding.fused.layout import Layout
from ctrflow.embedding.fused.routing import Route


def _pieces(layout: Layout, r: Route) -> tuple[list[tuple[int, int, int]], dict[int, list[tuple[int, int, int]]]]:
    """Where the vectors from each rank start in the returned buffer: (rank, start, tables) of each
    whole-table block, and per row-wise table its pieces (shard index, start, vectors), by shard."""
    blocks, rows, start = [], {f: [] for f in layout.row_feats}, 0
    for d in range(layout.world):
        blocks.append((d, start, len(layout.tab[d])))
        start += r.batch * len(layout.tab[d])
        for (f, s), c in zip(layout.row_slots[d], r.row_bags[d]):
            rows[f].append((layout.row_shards[f].index(s), start, c))
            start += c
    for pieces in rows.values():
        pieces.sort()
    return blocks, rows


def place_index(layout: Layout, r: Route, features: int, n_back: int, device, cache: dict) -> torch.Tensor:
    """[b, T]: for each (sample, table) its row in the forward's source buffer, which holds the
    returned vectors (in the order the ids were sent), then the replicated lookups [b, n_rep]
    (a row-split bag's column: row 0, for `add_row_bags` to overwrite)."""
    key = ("place", r.batch)
    if layout.static and key in cache:
        return cache[key]
    b = r.batch
    at = torch.arange(b, device=device)
    perm = (torch.zeros if layout.bag_rows else torch.empty)(b, features, dtype=torch.int64, device=device)
    blocks, rows = _pieces(layout, r)
    for d, start, n in blocks:
        for k, f in enumerate(layout.tab[d]):
            perm[:, f] = start + at * n + k
    for k, f in enumerate(layout.rep):
        perm[:, f] = n_back + at * len(layout.rep) + k
    for f, pieces in rows.items():  # sorted position j of shard k's piece -> its source row
        if f in layout.bag_rows:
            continue
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


def add_row_bags(out: torch.Tensor, src: torch.Tensor, layout: Layout, r: Route, ids: torch.Tensor) -> None:
    """Write each row-split bag's column of `out` [b, T, D]: its partial sums from `src` added per
    sample (in fp32), a mean divided by the bag's non-padding count."""
    _blocks, rows = _pieces(layout, r)
    for f in layout.bag_rows:
        src_rows = torch.cat([torch.arange(start, start + c, device=src.device) for _, start, c in rows[f]])
        acc = torch.zeros(r.batch, src.shape[1], dtype=torch.float32, device=src.device)
        acc.index_add_(0, r.bag_samples[f][:src_rows.shape[0]], src.index_select(0, src_rows).float())
        if layout.tables[f].pooling == "mean":
            a, z = layout.columns[f]
            acc /= bag_counts(ids[:, a:z]).unsqueeze(1)
        out[:, f] = acc.to(out.dtype)


def scale_row_means(grad: torch.Tensor, layout: Layout, ids: torch.Tensor) -> torch.Tensor:
    """grad [b, T, D] with each row-split mean bag's column divided by its count (what its partial
    sums' gradients are); the gradient as is when there is none."""
    means = [f for f in layout.bag_rows if layout.tables[f].pooling == "mean"]
    if not means:
        return grad
    grad = grad.clone()
    for f in means:
        a, z = layout.columns[f]
        grad[:, f] = (grad[:, f].float() / bag_counts(ids[:, a:z]).unsqueeze(1)).to(grad.dtype)
    return grad


def pack_index(layout: Layout, r: Route, features: int, device, cache: dict) -> torch.Tensor:
    """[vectors sent + b * n_rep]: the gradient row (sample * T + table) of each returned vector in
    the order the ids were sent, then the replicated tables' rows."""
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
            samples = r.bag_samples[f] if f in layout.bag_rows else r.row_orders[f]
            parts.append(samples[begin:begin + sizes[k]] * features + f)
    if layout.rep:
        parts.append((at + torch.tensor(layout.rep, device=device)).reshape(-1))
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    if layout.static:
        cache[key] = index
    return index


def _shard_sizes(layout: Layout, r: Route, f: int) -> list[int]:
    """Vectors per shard of row-wise table f in this step (one per id sent to each owner; a bag's
    partial sums)."""
    sizes = [0] * len(layout.row_shards[f])
    for d in range(layout.world):
        for (g, s), c in zip(layout.row_slots[d], r.row_bags[d]):
            if g == f:
                sizes[layout.row_shards[f].index(s)] = c
    return sizes
