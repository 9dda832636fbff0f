"""The fused GPU embedding path: one buffer for all tables, Triton lookup and optimizer-in-backward.

`FusedEmbeddingCollection` replaces `EmbeddingCollection` in any model (`replace_module`); without
CUDA or Triton it runs the same algorithm in torch, so it works (slowly) everywhere.
"""

from ctrflow.embedding.fused.collection import FusedEmbeddingCollection
from ctrflow.embedding.fused.ops import OPTIMIZERS

__all__ = ["FusedEmbeddingCollection", "OPTIMIZERS"]
