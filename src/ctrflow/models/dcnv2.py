"""DCNv2 (Wang et al. 2021): a low-rank cross network stacked with a deep MLP."""

from __future__ import annotations

from typing import Sequence

import torch

from ctrflow.contract.features import Features
from ctrflow.models.base import EMBEDDING_INIT_SCALE, RankingModel
from ctrflow.models.layers import MLP, LowRankCrossNet


class DCNv2(RankingModel):
    """dense arch [B, D] and embeddings [B, T, D] flattened to x0 [B, (T + 1) D] (T D without dense
    features); cross layers, then the deep MLP -> logits [B]."""

    def __init__(self, features: Features, embedding_dim: int = 16, bottom_mlp: Sequence[int] = (64, 32),
                 deep_mlp: Sequence[int] = (128, 64), cross_layers: int = 3, cross_rank: int = 32, seed: int = 0,
                 dropout: float = 0.0, embedding_init_scale: float = EMBEDDING_INIT_SCALE):
        super().__init__(features, embedding_dim, seed, embedding_init_scale)
        has_dense = features.num_dense > 0
        if has_dense:
            self.dense_arch = MLP(features.num_dense, [*bottom_mlp, embedding_dim])
        width = (len(features.sparse) + has_dense) * embedding_dim
        self.interaction = LowRankCrossNet(width, cross_layers, cross_rank)
        self.over_arch = MLP(width, [*deep_mlp, 1], last_activation=False, dropout=dropout)

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The concatenation, cross layers and deep MLP, compiled together on the fast path."""
        if self.dense_arch is None:
            return self.over_arch(self.interaction(embedded.flatten(1))).squeeze(1)
        bottom = self.dense_arch(dense)  # [B, D]
        crossed = self.interaction(bottom, embedded.flatten(1))  # x0 = [bottom, embedded]: [B, (T + 1) D]
        return self.over_arch(crossed).squeeze(1)
