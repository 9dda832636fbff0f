"""The plain (single-process) embedding collection: the reference every faster path matches."""

from __future__ import annotations

import math

import torch
from torch import nn

from ctrflow.embedding.tables import TableConfig


def init_table(table: TableConfig, seed: int, index: int) -> torch.Tensor:
    """Deterministic initial weights of one whole table, whatever the later sharding.

    DLRM's uniform(-1/sqrt(n), 1/sqrt(n)); seeded per table so that every process, and every
    sharding of the table, starts from the same numbers.
    """
    gen = torch.Generator().manual_seed(seed * 1000003 + index)
    bound = 1.0 / math.sqrt(table.num_embeddings)
    weight = torch.empty(table.num_embeddings, table.embedding_dim)
    return weight.uniform_(-bound, bound, generator=gen)


class EmbeddingCollection(nn.Module):
    """One id per feature per sample: ids [B, F] (int) -> embeddings [B, F, D].

    Weights are one parameter per table (`weights[table.name]`); lookups produce sparse
    gradients so that optimizers touch only the rows a batch used.
    """

    def __init__(self, tables: list[TableConfig], seed: int = 0):
        super().__init__()
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"all tables of one collection need one embedding_dim, got {sorted(dims)}")
        self.tables = list(tables)
        self.embedding_dim = dims.pop()
        self.weights = nn.ParameterDict(
            {t.name: nn.Parameter(init_table(t, seed, i)) for i, t in enumerate(self.tables)}
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        columns = [
            nn.functional.embedding(ids[:, i], self.weights[t.name], sparse=True)
            for i, t in enumerate(self.tables)
        ]
        return torch.stack(columns, dim=1)  # [B, F, D]

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name, for topology-independent checkpoints and export."""
        return {t.name: self.weights[t.name].detach() for t in self.tables}
