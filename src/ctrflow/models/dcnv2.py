"""DCNv2 (Wang et al. 2021): a low-rank cross network stacked with a deep MLP."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ctrflow.data.schema import DENSE, SPARSE
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.models.layers import MLP, LowRankCrossNet


class DCNv2(nn.Module):
    """dense arch [B, D] and embeddings [B, 26, D] flattened to x0 [B, 27 D];
    cross layers, then the deep MLP -> logits [B]."""

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int = 16,
                 bottom_mlp: Sequence[int] = (64, 32), deep_mlp: Sequence[int] = (128, 64),
                 cross_layers: int = 3, cross_rank: int = 32, seed: int = 0):
        super().__init__()
        width = (len(SPARSE) + 1) * embedding_dim
        self.dense_arch = MLP(len(DENSE), [*bottom_mlp, embedding_dim])
        self.embeddings = EmbeddingCollection(tables_for(table_sizes, list(SPARSE), embedding_dim), seed)
        self.interaction = LowRankCrossNet(width, cross_layers, cross_rank)
        self.over_arch = MLP(width, [*deep_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.head(dense, self.embeddings(sparse))

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Everything after the lookup: dense [B, 13] and embeddings [B, 26, D] -> logits [B].
        One function so that it can be compiled as one graph (the concatenation, cross layers and
        deep MLP fused together, their backward too), apart from the embeddings' own kernels."""
        bottom = self.dense_arch(dense)  # [B, D]
        crossed = self.interaction(bottom, embedded.flatten(1))  # x0 = [bottom, embedded]: [B, 27 D]
        return self.over_arch(crossed).squeeze(1)
