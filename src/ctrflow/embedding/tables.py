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


def check_ids(ids, tables: list[TableConfig]) -> None:
    """Raise `UserError` naming the feature when an id lies outside its table (before any lookup).

    `ids` is [B, F] with column f looked up in `tables[f]`. On a GPU this is a device-to-host sync.
    """
    import torch

    from ctrflow.errors import UserError

    if ids.dim() != 2 or ids.shape[1] != len(tables):
        raise UserError(f"expected ids of shape [batch, {len(tables)}], got {list(ids.shape)}")
    sizes = torch.tensor([t.num_embeddings for t in tables], device=ids.device)
    bad = (ids < 0) | (ids >= sizes)
    if bool(bad.any()):
        row, f = (int(x) for x in bad.nonzero()[0])
        t = tables[f]
        raise UserError(
            f"feature {t.feature}: id {int(ids[row, f])} in batch row {row} is outside table {t.name} "
            f"(0..{t.num_embeddings - 1}); does the data match the schema the model was built from?"
        )
