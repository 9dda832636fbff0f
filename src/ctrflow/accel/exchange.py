"""Running a model on `FusedShardedEmbeddingCollection` faster: exchanges started before the dense
layers (`forward_in_chunks`, optionally as micro-batches) and DLRM's interaction reading the exchange
buffers in place (`read_exchange_layout`; one-hot collections). Both keep the step exact: one table
update per step, the same gradients. Measured on 4 H200s: benchmarks/NOTES.md, "DLRM on several GPUs".
Both act on the model's typed parts (`ctrflow.models.RankingModel`: `embeddings`, `interaction`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ctrflow.accel.interaction import FusedDotInteraction
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection

if TYPE_CHECKING:  # the contract of the model's parts; embedding code imports no model
    from ctrflow.models.base import RankingModel


def forward_in_chunks(model: RankingModel, dense: torch.Tensor, ids: torch.Tensor, chunks: int = 1,
                      next_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`model(dense, ids)` (logits [B]); with a sharded fused `model.embeddings` its lookups and
    exchanges start before the model's first layer (the bottom MLP runs under the all-to-all), and
    `chunks` > 1 makes micro-batches whose every exchange starts first, so each chunk's exchange runs
    under the previous chunk's dense layers (backward: the reverse), still with one table update.
    `next_ids`: the next step's ids (its ids all-to-all then runs during this step; see
    `FusedShardedEmbeddingCollection.prefetch`). Any other collection runs the batch whole."""
    coll = model.embeddings
    if not isinstance(coll, FusedShardedEmbeddingCollection) or ids.shape[0] == 0:
        return model(dense, ids)
    parts = list(ids.chunk(max(1, min(chunks, ids.shape[0]))))
    coll.prefetch(parts, next_ids if len(parts) == 1 else None)
    if len(parts) == 1:
        return model(dense, parts[0])
    return torch.cat([model(d, i) for d, i in zip(dense.split([p.shape[0] for p in parts]), parts)])


def read_exchange_layout(model: RankingModel) -> bool:
    """Let `model.interaction` (a `FusedDotInteraction`) read `model.embeddings`' (a sharded fused
    collection with no row-wise shards and one-hot tables only: bags are pooled, not read in place)
    exchange buffers where they are, and hand its gradient back in that layout: no gather into
    [b, T, D] forward, none out of it backward. Only the interaction may read the embeddings then.
    Returns whether it applied."""
    coll, inter = model.embeddings, model.interaction
    if not isinstance(coll, FusedShardedEmbeddingCollection) or not isinstance(inter, FusedDotInteraction):
        return False
    rows = coll.exchange_rows()
    if rows is None:
        return False
    inter.read_rows(rows)
    coll.raw_output = True
    return True
