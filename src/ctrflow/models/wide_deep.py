"""Wide & Deep (Cheng et al. 2016): a linear model over ids and dense features plus a deep MLP."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctrflow.contract.features import Features
from ctrflow.models.base import EMBEDDING_INIT_SCALE, RankingModel
from ctrflow.models.layers import MLP
from ctrflow.models.spec import register


@dataclass(frozen=True)
class WideDeepConfig:
    """Wide&Deep's own settings (the dense features enter the deep part as they are: no dense arch)."""

    deep_mlp: tuple[int, ...] = field(default=(128, 64), metadata={"help": "deep MLP hidden widths (then -> 1)"})


class WideDeep(RankingModel):
    """wide: dim-1 embeddings (`linear_embeddings`) summed + a linear map of dense;
    deep: MLP over [dense, T embeddings flattened]; logits = wide + deep."""

    def __init__(self, features: Features, embedding_dim: int, settings: WideDeepConfig, seed: int = 0,
                 dropout: float = 0.0, embedding_init_scale: float = EMBEDDING_INIT_SCALE):
        super().__init__(features, embedding_dim, seed, embedding_init_scale)
        self.add_first_order(seed)
        width = features.num_dense + len(features.sparse) * embedding_dim
        self.over_arch = MLP(width, [*settings.deep_mlp, 1], last_activation=False, dropout=dropout)

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        deep_in = torch.cat([dense, embedded.flatten(1)], dim=1)  # [B, n + T D]
        return self.over_arch(deep_in).squeeze(1)


register("wide_deep", WideDeep, WideDeepConfig)
