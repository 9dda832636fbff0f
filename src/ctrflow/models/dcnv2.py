"""DCNv2 (Wang et al. 2021): a low-rank cross network stacked with a deep MLP."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctrflow.contract.features import Features
from ctrflow.models.base import EMBEDDING_INIT_SCALE, RankingModel
from ctrflow.models.layers import MLP, LowRankCrossNet
from ctrflow.models.spec import register


@dataclass(frozen=True)
class DCNv2Config:
    """DCNv2's own settings."""

    bottom_mlp: tuple[int, ...] = field(default=(64, 32), metadata={
        "help": "dense arch hidden widths (then -> embedding dim)"})
    deep_mlp: tuple[int, ...] = field(default=(128, 64), metadata={"help": "deep MLP hidden widths (then -> 1)"})
    cross_layers: int = field(default=3, metadata={"help": "cross layers"})
    cross_rank: int = field(default=32, metadata={"help": "low-rank factor of each cross layer"})


class DCNv2(RankingModel):
    """dense arch [B, D] and embeddings [B, T, D] flattened to x0 [B, (T + 1) D] (T D without dense
    features); cross layers, then the deep MLP -> logits [B]."""

    head_is_one_graph = True

    def __init__(self, features: Features, embedding_dim: int, settings: DCNv2Config, seed: int = 0,
                 dropout: float = 0.0, embedding_init_scale: float = EMBEDDING_INIT_SCALE):
        super().__init__(features, embedding_dim, seed, embedding_init_scale)
        has_dense = features.num_dense > 0
        if has_dense:
            self.dense_arch = MLP(features.num_dense, [*settings.bottom_mlp, embedding_dim])
        width = (len(features.sparse) + has_dense) * embedding_dim
        self.interaction = LowRankCrossNet(width, settings.cross_layers, settings.cross_rank)
        self.over_arch = MLP(width, [*settings.deep_mlp, 1], last_activation=False, dropout=dropout)

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The concatenation, cross layers and deep MLP, compiled together on the fast path."""
        if self.dense_arch is None:
            return self.over_arch(self.interaction(embedded.flatten(1))).squeeze(1)
        bottom = self.dense_arch(dense)  # [B, D]
        crossed = self.interaction(bottom, embedded.flatten(1))  # x0 = [bottom, embedded]: [B, (T + 1) D]
        return self.over_arch(crossed).squeeze(1)


register("dcnv2", DCNv2, DCNv2Config)
