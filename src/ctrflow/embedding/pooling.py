"""Multi-hot bags: from the vectors of every id slot to one vector per table.

A batch's ids are [B, S]: each table takes `length` consecutive slots (`TableConfig.length`, 1 for a
categorical feature). Every collection (plain, fused, sharded) looks up all slots, [B, S, D], and
hands them here: a one-id table's slot is its vector as is (id 0, "missing", has a learned row); a
multi-hot table's slots are pooled, padding (id 0) contributing nothing: `sum` adds the vectors of
its non-padding ids, `mean` divides that sum by their count (an empty bag gives zeros either way).
Backward follows from the same arithmetic: a padding slot's vector gets a zero gradient.
`slot_scales` states it per slot (each slot's weight in its table's output: 1 for a one-id table,
0 for padding, 1 for a sum bag's id, 1/count for a mean bag's), so collections that apply the
gradient themselves (the fused ones) feed grad[:, table] x scale to their row update.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ctrflow.embedding.tables import TableConfig
from ctrflow.contract.features import PADDING_ID


def slot_count(tables: Sequence[TableConfig]) -> int:
    """Id slots per sample: the width of the [B, S] ids the collection takes."""
    return sum(t.length for t in tables)


def is_one_hot(tables: Sequence[TableConfig]) -> bool:
    """Every table takes one id, looked up as is: the slots are the output, no pooling."""
    return all(t.length == 1 and t.pooling is None for t in tables)


def slot_tables(tables: Sequence[TableConfig]) -> list[int]:
    """The table index of every slot, [S]."""
    return [i for i, t in enumerate(tables) for _ in range(t.length)]


def slot_scales(ids: torch.Tensor, tables: Sequence[TableConfig]) -> torch.Tensor:
    """ids [B, S] -> [B, S] float32: each slot's weight in its table's output (module doc), so that
    pool_bags(values)[:, t] = sum over t's slots s of values[:, s] * scale[:, s]."""
    out, start = [], 0
    for t in tables:
        stop = start + t.length
        if t.pooling is None:
            out.append(torch.ones(ids.shape[0], t.length, device=ids.device))
        else:
            present = (ids[:, start:stop] != PADDING_ID).float()  # [B, L]
            if t.pooling == "mean":
                present = present / present.sum(dim=1, keepdim=True).clamp_min(1)
            out.append(present)
        start = stop
    if not out:
        return torch.zeros(ids.shape[0], 0, device=ids.device)
    return torch.cat(out, dim=1)


def pool_bags(values: torch.Tensor, ids: torch.Tensor, tables: Sequence[TableConfig]) -> torch.Tensor:
    """values [B, S, D] (slot vectors) and ids [B, S] -> [B, T, D], T = len(tables) (module doc)."""
    if is_one_hot(tables):
        return values
    out, start = [], 0
    for t in tables:
        stop = start + t.length
        if t.pooling is None:
            out.append(values[:, start])
        else:
            present = (ids[:, start:stop] != PADDING_ID).unsqueeze(2)  # [B, L, 1]
            bag = (values[:, start:stop] * present.to(values.dtype)).sum(dim=1)  # [B, D]
            if t.pooling == "mean":
                bag = bag / present.sum(dim=1).clamp_min(1).to(bag.dtype)
            out.append(bag)
        start = stop
    if not out:
        return values.new_zeros(values.shape[0], 0, values.shape[2])
    return torch.stack(out, dim=1)
