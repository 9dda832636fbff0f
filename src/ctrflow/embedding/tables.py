"""Embedding tables described as data; the sharding plan is computed outside the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_embeddings` rows of `embedding_dim`, looked up by one feature."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature: str

    @property
    def bytes(self) -> int:
        """fp32 size of the weights."""
        return self.num_embeddings * self.embedding_dim * 4


def tables_for(cardinalities: list[int], features: list[str], dim: int, prefix: str = "t") -> list[TableConfig]:
    """One table per categorical feature, sized by its cardinality."""
    return [TableConfig(f"{prefix}_{f}", int(n), dim, f) for n, f in zip(cardinalities, features)]
