"""`RankingModel`: the parts every ranking model is made of, and the contract faster paths rely on.

A ranking model maps `dense` [B, num_dense] float32 and `sparse` [B, slots] int ids (the feature
contract, `ctrflow.contract.features`) to logits [B] through named parts:

- `dense_arch`: an `MLP` from the dense features to one vector [B, D] (None without dense features,
  or where the model reads the dense features directly: Wide&Deep);
- `embeddings`: an `EmbeddingCollection`, one table per sparse feature -> [B, T, D];
- `interaction`: the model's own layer over the dense vector and the embeddings (None: a plain
  concatenation);
- `over_arch`: the `MLP` to the logit;
- `linear_embeddings` and `linear_dense` (DeepFM, Wide&Deep; None elsewhere): first-order terms, a
  dim-1 collection and a linear map of the dense features.

`forward(dense, sparse) = head(dense, embeddings(sparse)) + first_order(dense, sparse)`. `head`
is everything after the lookup: one function, so that it can be compiled as one graph apart from
the embeddings' own kernels. Models know nothing of devices, processes, sharding, the loss or any
dataset's column names; they are built from `Features`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.contract.features import Features
from ctrflow.models.layers import MLP

# the tables' uniform(+-1/sqrt(rows)) draw times this (`ModelConfig.embedding_init_scale`, the same default)
EMBEDDING_INIT_SCALE = 0.1


class RankingModel(nn.Module):
    """Base of DLRM, DCNv2, DeepFM and Wide&Deep (module doc); subclasses build the parts and `head`."""

    dense_arch: MLP | None
    embeddings: EmbeddingCollection
    interaction: nn.Module | None
    over_arch: MLP
    linear_embeddings: EmbeddingCollection | None
    linear_dense: nn.Linear | None
    # True where the embeddings reach the output only through products of each other (DLRM without dense
    # features): near zero their gradients vanish with them, and the embedding L2 would hold them there
    products_only: bool = False
    # True where everything after the lookup (`head`) is best made one compiled graph: DCNv2's
    # concatenation, cross layers and deep MLP fuse; DLRM's interaction has kernels of its own
    head_is_one_graph: bool = False

    def __init__(self, features: Features, embedding_dim: int, seed: int = 0,
                 embedding_init_scale: float = EMBEDDING_INIT_SCALE):
        super().__init__()
        self.features = features
        self.embedding_dim = embedding_dim
        tables = tables_for(features.sparse, embedding_dim, init_scale=embedding_init_scale)
        self.embeddings = EmbeddingCollection(tables, seed, embedding_dim)
        self.dense_arch = self.interaction = self.linear_embeddings = self.linear_dense = None

    def add_first_order(self, seed: int) -> None:
        """First-order terms: a dim-1 table per sparse feature and a linear map of the dense features,
        starting at zero as a linear model does. Drawn at random, they rank the rows at random before
        any training (the dense map weighs unnormalised inputs), and the small steps of the first
        batches take long to undo that: on 20,000 rows Wide&Deep's validation AUC stayed below 0.5
        for its whole first epoch."""
        tables = tables_for(self.features.sparse, 1, prefix="linear", init="zeros")
        self.linear_embeddings = EmbeddingCollection(tables, seed + 1, 1)
        self.linear_dense = None
        if self.features.num_dense:
            self.linear_dense = nn.Linear(self.features.num_dense, 1)
            with torch.no_grad():
                self.linear_dense.weight.zero_()
                self.linear_dense.bias.zero_()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        logits = self.head(dense, self.embeddings(sparse))
        if self.linear_embeddings is not None:
            logits = logits + self.first_order(dense, sparse)
        return logits

    def head(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """dense [B, num_dense] and embeddings [B, T, D] -> logits [B] (without first-order terms)."""
        raise NotImplementedError

    def first_order(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Sum of the first-order weights of a row's ids and of the linear map of its dense features: [B]."""
        total = self.linear_embeddings(sparse).sum(dim=(1, 2))
        if self.linear_dense is not None:
            total = total + self.linear_dense(dense).squeeze(1)
        return total

    @property
    def output_bias(self) -> nn.Parameter:
        """The output layer's bias [1]: the logit's constant term."""
        return self.over_arch[-1].bias

    @torch.no_grad()
    def set_output_bias(self, rate: float) -> None:
        """Start every prediction at click rate `rate` (the training split's mean label): the output
        layer's bias becomes logit(rate) and the first-order dense bias 0. A model that starts at 0.5
        spends its first steps pushing every score down, the most frequent ids the most."""
        rate = min(max(float(rate), 1e-6), 1 - 1e-6)
        self.output_bias.fill_(math.log(rate / (1 - rate)))
        if self.linear_dense is not None:
            self.linear_dense.bias.zero_()
