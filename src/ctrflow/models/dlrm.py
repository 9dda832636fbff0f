"""DLRM (Naumov et al. 2019): bottom MLP, embeddings, pairwise dot interaction, top MLP."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ctrflow.data.schema import DENSE, SPARSE
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.models.layers import MLP, DotInteraction, pad_input_columns


class DLRM(nn.Module):
    """dense [B, 13] -> dense arch -> [B, D]; ids [B, 26] -> embeddings [B, 26, D];
    dot interaction over the 27 vectors -> [B, D + 351 pairs, zero-padded to a multiple of 8]
    (MLPerf's 480 at D = 128); over arch -> logits [B]."""

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int = 16,
                 bottom_mlp: Sequence[int] = (64, 32), top_mlp: Sequence[int] = (128, 64), seed: int = 0):
        super().__init__()
        self.dense_arch = MLP(len(DENSE), [*bottom_mlp, embedding_dim])
        self.embeddings = EmbeddingCollection(tables_for(table_sizes, list(SPARSE), embedding_dim), seed)
        self.interaction = DotInteraction(len(SPARSE) + 1, embedding_dim)  # [B, D + 351 + zero pad]
        pad = self.interaction.pad  # drawn as the unpadded layer, then zero columns appended
        self.over_arch = MLP(self.interaction.out_features - pad, [*top_mlp, 1], last_activation=False)
        self.over_arch[0] = pad_input_columns(self.over_arch[0], pad)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        bottom = self.dense_arch(dense)  # [B, D]
        embedded = self.embeddings(sparse)  # [B, 26, D]
        return self.over_arch(self.interaction(bottom, embedded)).squeeze(1)
