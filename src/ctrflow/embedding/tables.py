"""Embedding tables described as data; the sharding plan is computed outside the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_embeddings` rows of `embedding_dim`, looked up by one feature.

    `length` ids per sample (1: categorical, one lookup; more: a multi-hot bag of `length` slots
    padded with id 0, whose looked-up vectors are pooled by `pooling`, sum or mean, padding
    contributing nothing). A batch's ids are [B, slots] with each table's `length` slots in order.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature: str
    length: int = 1
    pooling: str | None = None  # None: one id per sample, looked up as is (id 0 = missing has a row)
    init: str = "uniform"  # DLRM's uniform(-1/sqrt(rows), 1/sqrt(rows)) | "zeros" (first-order weights)
    init_scale: float = 1.0  # the uniform draw is multiplied by this (`ModelConfig.embedding_init_scale`)

    @property
    def bytes(self) -> int:
        """fp32 size of the weights."""
        return self.num_embeddings * self.embedding_dim * 4


def tables_for(features, dim: int, prefix: str = "t", init: str = "uniform",
               init_scale: float = 1.0) -> list[TableConfig]:
    """One table per sparse feature (`ctrflow.contract.features.Feature`), sized by its cardinality."""
    return [TableConfig(f"{prefix}_{f.name}", int(f.cardinality), dim, f.name, f.width,
                        f.pooling if f.kind == "multi_hot" else None, init, init_scale) for f in features]


def check_ids(ids, tables: list[TableConfig]) -> None:
    """Raise `UserError` naming the feature when an id lies outside its table (before any lookup).

    `ids` is [B, slots]: each table's `length` consecutive slots, in order (one slot per table when
    every feature is categorical). On a GPU this is a device-to-host sync.
    """
    import torch

    from ctrflow.errors import UserError

    slots = sum(t.length for t in tables)
    if ids.dim() != 2 or ids.shape[1] != slots:
        raise UserError(f"expected ids of shape [batch, {slots}], got {list(ids.shape)}")
    owner = [i for i, t in enumerate(tables) for _ in range(t.length)]  # [slots] table of each slot
    sizes = torch.tensor([tables[i].num_embeddings for i in owner], device=ids.device, dtype=torch.int64)
    bad = (ids < 0) | (ids >= sizes)
    if bool(bad.any()):
        row, slot = (int(x) for x in bad.nonzero()[0])
        t = tables[owner[slot]]
        raise UserError(
            f"feature {t.feature}: id {int(ids[row, slot])} in batch row {row} is outside table {t.name} "
            f"(0..{t.num_embeddings - 1}); does the data match the schema the model was built from?"
        )
