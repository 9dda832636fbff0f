"""Wide & Deep (Cheng et al. 2016): a linear model over ids and dense features plus a deep MLP."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ctrflow.data.schema import DENSE, SPARSE
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.models.layers import MLP


class WideDeep(nn.Module):
    """wide: dim-1 embeddings (`linear_embeddings`) summed + a linear map of dense;
    deep: MLP over [dense, 26 embeddings flattened]; logits = wide + deep."""

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int = 16,
                 deep_mlp: Sequence[int] = (128, 64), seed: int = 0):
        super().__init__()
        self.embeddings = EmbeddingCollection(tables_for(table_sizes, list(SPARSE), embedding_dim), seed)
        self.linear_embeddings = EmbeddingCollection(
            tables_for(table_sizes, list(SPARSE), 1, prefix="linear"), seed + 1)
        self.linear_dense = nn.Linear(len(DENSE), 1)
        self.over_arch = MLP(len(DENSE) + len(SPARSE) * embedding_dim, [*deep_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        wide = self.linear_embeddings(sparse).sum(dim=(1, 2)) + self.linear_dense(dense).squeeze(1)
        deep_in = torch.cat([dense, self.embeddings(sparse).flatten(1)], dim=1)  # [B, 13 + 26 D]
        return wide + self.over_arch(deep_in).squeeze(1)
