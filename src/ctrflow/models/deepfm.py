"""DeepFM (Guo et al. 2017): first-order terms + FM second order + a deep MLP, one shared embedding."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ctrflow.data.schema import DENSE, SPARSE
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.models.layers import MLP, FactorizationMachine


class DeepFM(nn.Module):
    """The dense features enter as one more field (dense arch -> [B, D]) beside the 26 embeddings;
    first-order weights are a dim-1 collection (`linear_embeddings`) plus a linear map of dense."""

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int = 16,
                 bottom_mlp: Sequence[int] = (64, 32), deep_mlp: Sequence[int] = (128, 64), seed: int = 0):
        super().__init__()
        fields = len(SPARSE) + 1
        self.dense_arch = MLP(len(DENSE), [*bottom_mlp, embedding_dim])
        self.embeddings = EmbeddingCollection(tables_for(table_sizes, list(SPARSE), embedding_dim), seed)
        # other seed: first-order tables start differently from the vectors
        self.linear_embeddings = EmbeddingCollection(
            tables_for(table_sizes, list(SPARSE), 1, prefix="linear"), seed + 1)
        self.linear_dense = nn.Linear(len(DENSE), 1)
        self.interaction = FactorizationMachine()
        self.over_arch = MLP(fields * embedding_dim, [*deep_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bottom = self.dense_arch(dense)  # [B, D]
        fields = torch.cat([bottom.unsqueeze(1), self.embeddings(sparse)], dim=1)  # [B, 27, D]
        first = self.linear_embeddings(sparse).sum(dim=(1, 2)) + self.linear_dense(dense).squeeze(1)
        second = self.interaction(fields)  # [B]
        deep = self.over_arch(fields.flatten(1)).squeeze(1)
        return first + second + deep
