"""DLRM (Naumov et al. 2019): bottom MLP, embeddings, pairwise dot interaction, top MLP."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ctrflow.contract.features import Features
from ctrflow.models.base import EMBEDDING_INIT_SCALE, RankingModel
from ctrflow.models.layers import MLP, DotInteraction, pad_input_columns
from ctrflow.models.spec import register


@dataclass(frozen=True)
class DLRMConfig:
    """DLRM's own settings."""

    bottom_mlp: tuple[int, ...] = field(default=(64, 32), metadata={
        "help": "dense arch hidden widths (then -> embedding dim)"})  # 13 -> 64 -> 32 -> embedding_dim
    top_mlp: tuple[int, ...] = field(default=(128, 64), metadata={"help": "over arch hidden widths (then -> 1)"})


class DLRM(RankingModel):
    """dense [B, n] -> dense arch -> [B, D]; ids -> embeddings [B, T, D]; dot interaction over the
    T + 1 vectors -> [B, D + pairs, zero-padded to a multiple of 8] (MLPerf's 128 + 351 = 479 -> 480);
    over arch -> logits [B]. Without dense features there is no dense arch: the interaction is over
    the T embeddings alone."""

    def __init__(self, features: Features, embedding_dim: int, settings: DLRMConfig, seed: int = 0,
                 dropout: float = 0.0, embedding_init_scale: float = EMBEDDING_INIT_SCALE):
        super().__init__(features, embedding_dim, seed, embedding_init_scale)
        has_dense = features.num_dense > 0
        if has_dense:
            self.dense_arch = MLP(features.num_dense, [*settings.bottom_mlp, embedding_dim])
        tables = len(features.sparse)
        self.products_only = not has_dense  # the T embeddings' dot products alone reach the over arch
        self.interaction = DotInteraction(tables + has_dense, embedding_dim, dense=has_dense)
        pad = self.interaction.pad  # drawn as the unpadded layer, then zero columns appended
        self.over_arch = MLP(self.interaction.out_features - pad, [*settings.top_mlp, 1], last_activation=False,
                             dropout=dropout)
        self.over_arch[0] = pad_input_columns(self.over_arch[0], pad)

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        bottom = self.dense_arch(dense) if self.dense_arch is not None else None  # [B, D]
        return self.over_arch(self.interaction(bottom, embedded)).squeeze(1)


register("dlrm", DLRM, DLRMConfig)
