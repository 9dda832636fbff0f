"""DeepFM (Guo et al. 2017): first-order terms + FM second order + a deep MLP, one shared embedding."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctrflow.contract.features import Features
from ctrflow.models.base import EMBEDDING_INIT_SCALE, RankingModel
from ctrflow.models.layers import MLP, FactorizationMachine
from ctrflow.models.spec import register


@dataclass(frozen=True)
class DeepFMConfig:
    """DeepFM's own settings."""

    bottom_mlp: tuple[int, ...] = field(default=(64, 32), metadata={
        "help": "dense arch hidden widths (then -> embedding dim)"})
    deep_mlp: tuple[int, ...] = field(default=(128, 64), metadata={"help": "deep MLP hidden widths (then -> 1)"})


class DeepFM(RankingModel):
    """The dense features enter as one more field (dense arch -> [B, D]) beside the T embeddings;
    first-order weights are a dim-1 collection (`linear_embeddings`) plus a linear map of dense."""

    def __init__(self, features: Features, embedding_dim: int, settings: DeepFMConfig, seed: int = 0,
                 dropout: float = 0.0, embedding_init_scale: float = EMBEDDING_INIT_SCALE):
        super().__init__(features, embedding_dim, seed, embedding_init_scale)
        has_dense = features.num_dense > 0
        if has_dense:
            self.dense_arch = MLP(features.num_dense, [*settings.bottom_mlp, embedding_dim])
        self.add_first_order(seed)
        self.interaction = FactorizationMachine()
        fields = len(features.sparse) + has_dense
        self.over_arch = MLP(fields * embedding_dim, [*settings.deep_mlp, 1], last_activation=False, dropout=dropout)

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        fields = embedded
        if self.dense_arch is not None:
            fields = torch.cat([self.dense_arch(dense).unsqueeze(1), embedded], dim=1)  # [B, T + 1, D]
        return self.interaction(fields) + self.over_arch(fields.flatten(1)).squeeze(1)


register("deepfm", DeepFM, DeepFMConfig)
