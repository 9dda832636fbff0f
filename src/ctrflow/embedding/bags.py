"""Multi-hot bags on the sharded paths: where a bag is pooled, and what both sharded collections share.

A bag is pooled by the rank that owns its table's rows, before the vectors travel back: a multi-hot
table returns one vector per sample, the [b, D] a one-hot table returns, not one per id ([b, length,
D]); DLRMv2's 214 ids a sample in 26 tables come back as 26 vectors (and their gradients go out as
26), 8x less traffic than looking every id up for the requester to pool. How, per sharding type:
- whole tables (table-wise; column-wise, each shard pooling its own columns): the owner receives a
  sample's whole bag, [b, length] ids with their padding, so every size follows from b and the
  lengths (the fused path's static all-to-all, capturable in a CUDA graph) and the owner applies
  the pooling rule itself, mean included (`pool_bags`; on the fused path `OwnerPool`, the same sums
  in fp32). Padding travels as ids (8 bytes against a vector of D floats);
- row-wise: a bag's ids spread over the shards owning them. The requester sends each shard only its
  ids (padding dropped: it sorts by owner anyway) and, in one more all_to_all, each id's bag number in
  that shard's piece (`sort_bag_items`); the owner returns one partial sum per (sample, shard) and
  the requester adds them, dividing a mean by the bag's non-padding count, known from its own ids;
- replicated: looked up and pooled locally.
Backward runs the same way back: the owner spreads each bag's gradient over the bag's ids (divided
by the count for a mean, zero for padding: the adjoint of `pool_bags`).

Where padding travels it is looked up, as in the plain collection, and gets a zero gradient; where it
is dropped (row-wise) its row is not touched. Both leave the row as it is under every optimizer: id 0
of a multi-hot table is only ever padding, so its gradient, and hence its optimizer state, stay zero.
One-hot tables (one id, no pooling) take none of this: their ids and vectors travel as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from ctrflow.embedding.pooling import is_one_hot
from ctrflow.embedding.tables import TableConfig, check_ids
from ctrflow.contract.features import PADDING_ID


def is_bag(table: TableConfig) -> bool:
    """Whether a table's slots are pooled (a multi-hot bag), rather than one id looked up as is."""
    return table.pooling is not None


def slot_columns(tables: Sequence[TableConfig]) -> list[tuple[int, int]]:
    """Each table's [start, stop) columns of the batch's ids [b, S]."""
    out, start = [], 0
    for t in tables:
        if t.pooling is None and t.length != 1:
            raise ValueError(f"table {t.name}: {t.length} slots need a pooling (sum or mean)")
        out.append((start, start + t.length))
        start += t.length
    return out


def one_id_tables(tables: Sequence[TableConfig]) -> list[TableConfig]:
    """The tables as one-id tables (same name, rows and dim): what a shard's storage is built from."""
    return [t if is_one_hot([t]) else replace(t, length=1, pooling=None) for t in tables]


def check_slot_ids(ids: torch.Tensor, tables: Sequence[TableConfig]) -> None:
    """`check_ids` for ids [b, S] (every slot within its table; a `UserError` naming the feature)."""
    check_ids(ids, _per_slot(tuple(tables)))


@lru_cache(maxsize=64)
def _per_slot(tables: tuple[TableConfig, ...]) -> list[TableConfig]:
    """The tables as one one-id table per slot (the same list for one-hot tables)."""
    if is_one_hot(tables):
        return list(tables)
    return [replace(t, length=1, pooling=None) for t in tables for _ in range(t.length)]


def bag_counts(ids: torch.Tensor) -> torch.Tensor:
    """ids [b, L] of bags -> [b] the divisor of a mean: non-padding ids, at least 1 (an empty bag is 0s)."""
    return (ids != PADDING_ID).sum(dim=1).clamp_min(1)


@dataclass
class BagItems:
    """One row-wise bag table's ids of a batch, grouped by owning shard (`sort_bag_items`)."""

    ids: torch.Tensor  # [n] shard-local ids, shard by shard (then the dropped padding: not sent)
    ranks: torch.Tensor  # [n] each id's bag number within its shard's piece
    items: torch.Tensor  # [shards] ids per shard (on the device)
    bags: torch.Tensor  # [shards] bags per shard: samples with an id there
    samples: torch.Tensor  # the sample of every bag, shard by shard (the first sum(bags) entries)


def sort_bag_items(ids: torch.Tensor, starts: torch.Tensor) -> BagItems:
    """ids [b, L] of a row-wise bag table whose shards start at rows `starts` [k] -> each shard's
    piece: its ids made shard-local, in sample order, with their bag numbers; padding dropped.
    No host sync (the counts are device tensors)."""
    b, length = ids.shape
    shards = starts.numel()
    flat = ids.reshape(-1)  # sample-major: a stable sort keeps each shard's ids in sample order
    owner = torch.bucketize(flat, starts[1:], right=True)
    owner = torch.where(flat == PADDING_ID, torch.full_like(owner, shards), owner)
    order = torch.argsort(owner, stable=True)
    own = owner[order]
    sample = order // length
    new = torch.ones_like(own, dtype=torch.bool)
    new[1:] = (sample[1:] != sample[:-1]) | (own[1:] != own[:-1])
    bag = torch.cumsum(new, 0) - 1  # [n] the bag number over all pieces
    items = own.new_zeros(shards + 1).index_add_(0, own, torch.ones_like(own))[:shards]
    bags = own.new_zeros(shards + 1).index_add_(0, own, new.to(own.dtype))[:shards]
    first = torch.cumsum(bags, 0) - bags
    kept = own.clamp(max=shards - 1)
    samples = own.new_zeros(b * length).scatter_(0, bag, sample)
    return BagItems(flat[order] - starts[kept], bag - first[kept], items, bags, samples)
