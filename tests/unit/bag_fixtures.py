"""Multi-hot tables, batches and one-process references for the sharding parity tests.

The references apply the pooling rule directly (`pool_bags` on every slot's row): the plain one looks
every slot up with `nn.functional.embedding` (sparse gradients for `SparseOptimizer`), the fused one
with `ops.lookup`, stepping `ops.update_rows` on every slot's gradient in backward, as one fused
process fed the global batch does.
"""

from __future__ import annotations

import torch
from torch import nn

from ctrflow.embedding.bags import one_id_tables
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection, ops
from ctrflow.embedding.pooling import pool_bags
from ctrflow.embedding.tables import TableConfig


def bag_tables(dim: int, scale: int = 1) -> list[TableConfig]:
    """One-hot tables between multi-hot bags (sum and mean); one tiny table, one bag of one slot."""
    return [TableConfig("t_a", 7 * scale, dim, "C1"),
            TableConfig("t_g", 40 * scale, dim, "G", length=4, pooling="sum"),
            TableConfig("t_b", 3, dim, "C2"),
            TableConfig("t_h", 23 * scale, dim, "H", length=3, pooling="mean"),
            TableConfig("t_c", 30 * scale, dim, "C3"),
            TableConfig("t_k", 11 * scale, dim, "K", length=1, pooling="mean")]


def bag_batches(tables: list[TableConfig], batch: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """`steps` global batches of ids [batch, slots]: bags padded with 0 anywhere in the bag (about
    40% of their slots), sample 0's bags empty, one-hot ids anywhere in their table (0 included)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        cols = []
        for t in tables:
            ids = torch.randint(0, t.num_embeddings, (batch, t.length), generator=gen)
            if t.pooling is not None:
                ids[torch.rand(batch, t.length, generator=gen) < 0.4] = 0
                ids[0] = 0
            cols.append(ids)
        out.append(torch.cat(cols, 1))
    return out


class SlotReference(nn.Module):
    """The plain collection's rule: every slot looked up in its table, then `pool_bags` -> [B, T, D]."""

    def __init__(self, tables: list[TableConfig], seed: int):
        super().__init__()
        self.tables = list(tables)
        self.inner = EmbeddingCollection(tables, seed=seed)  # the weights `SparseOptimizer` steps

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        slots = [nn.functional.embedding(ids[:, s], self.inner.weights[t.name], sparse=True)
                 for s, t in enumerate(t for t in self.tables for _ in range(t.length))]
        return pool_bags(torch.stack(slots, dim=1), ids, self.tables)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name."""
        return self.inner.full_weights()


class _FusedSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, anchor, coll, offsets):
        ctx.coll, ctx.ids, ctx.offsets = coll, ids, offsets
        return ops.lookup(ids, offsets, coll.weight, coll.output_dtype)

    @staticmethod
    def backward(ctx, grad):
        c = ctx.coll
        ops.update_rows(ctx.ids, ctx.offsets, grad, c.weight, c.row_state, c.scratch, c.pre_reduce)
        return None, None, None, None


class FusedSlotReference(nn.Module):
    """One fused process: every slot's row from one buffer, `pool_bags`, each slot's gradient stepped
    by the fused optimizer in backward (weights drawn like `EmbeddingCollection(tables, seed)`'s)."""

    def __init__(self, tables: list[TableConfig], seed: int, device="cpu", **options):
        super().__init__()
        self.tables = list(tables)
        plain = EmbeddingCollection(one_id_tables(tables), seed=seed)
        self.coll = FusedEmbeddingCollection.from_collection(plain, device=device, **options)
        starts = self.coll.offsets.tolist()
        self.register_buffer("slot_offsets", torch.tensor([starts[i] for i, t in enumerate(tables)
                                                           for _ in range(t.length)], device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        anchor = ids.new_empty(0, dtype=torch.float32).requires_grad_(torch.is_grad_enabled())
        return pool_bags(_FusedSlots.apply(ids, anchor, self.coll, self.slot_offsets), ids, self.tables)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name."""
        return self.coll.full_weights()

    def table_states(self, keys: dict[str, str]) -> dict:
        """Optimizer state as whole tables (see `FusedEmbeddingCollection.table_states`)."""
        return self.coll.table_states(keys)
