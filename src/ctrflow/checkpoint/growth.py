"""A checkpoint's tables and their optimizer state grown to a larger vocabulary (a warm start).

Vocabularies grown with `ctrflow preprocess --vocab-from` keep every old id and add new ids at the
end, so a table trained on the old vocabulary is the first rows of the new table. These mappings
give the loaders (`load_model_state`, `Optimizers.load_state_dict`, any sharding) whole tables of the
new size, one at a time, as a checkpoint's own `TableFiles` and `StateFiles` do:
- weights: the checkpoint's rows, then the new rows as a fresh model of the new size draws them
  (`ctrflow.embedding.collection.init_rows`: the same numbers for those rows, whatever the sharding);
- optimizer state: the checkpoint's rows, then zeros (a new row has no history), for every state
  tensor the run's optimizer keeps (a table the checkpoint never stepped starts at zero too).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ctrflow.embedding.collection import init_rows
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError
from ctrflow.models import embedding_collections


@dataclass(frozen=True)
class TableSlot:
    """Where a table sits in a fresh model: its config (new size), its index in its collection, and
    the collection's seed (what `init_rows` draws from)."""

    table: TableConfig
    index: int
    seed: int


def table_slots(fresh: nn.Module) -> dict[str, TableSlot]:
    """`{"<collection path>.<table>": TableSlot}` of a model as `build_model` makes it (tables may be
    deferred: nothing is drawn)."""
    return {f"{path}.{t.name}": TableSlot(t, i, collection.seed)
            for path, collection in embedding_collections(fresh).items() for i, t in enumerate(collection.tables)}


def grow_rows(old: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """`old` [n, ...] with rows n..rows-1 from `fill(n, rows)` appended (`old` itself when n == rows)."""
    if old.shape[0] == rows:
        return old
    return torch.cat([old, fill(old.shape[0], rows).to(old.dtype)])


class GrownTables(Mapping):
    """A checkpoint's whole tables by `"<collection path>.<table>"`, each grown to its slot's rows (new
    rows drawn by `init_rows`); a table larger than its slot is a UserError naming it."""

    def __init__(self, saved: Mapping, slots: dict[str, TableSlot], where: str):
        self.saved, self.slots, self.where = saved, slots, where

    def __getitem__(self, key: str) -> torch.Tensor:
        old, slot = self.saved[key], self.slots[key]
        t = slot.table
        if old.shape[0] > t.num_embeddings or (old.dim() == 2 and old.shape[1] != t.embedding_dim):
            raise UserError(f"{self.where}: table {key} has shape {tuple(old.shape)} in the checkpoint, more than "
                            f"this data's {(t.num_embeddings, t.embedding_dim)}")
        return grow_rows(old, t.num_embeddings, lambda a, b: init_rows(t, slot.seed, slot.index, a, b))

    def __iter__(self) -> Iterator[str]:
        return iter(self.saved)

    def __len__(self) -> int:
        return len(self.saved)


class GrownStates(Mapping):
    """A checkpoint's optimizer state `{table: {key: whole tensor}}`, each tensor grown to the table's
    new rows with zeros; `keys` per table: the state the run keeps (a key the checkpoint lacks: zeros)."""

    def __init__(self, saved: Mapping, tables: dict[str, TableConfig], keys: dict[str, tuple[str, ...]]):
        self.saved, self.tables, self.keys = saved, tables, keys

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        t = self.tables[name]
        saved = self.saved[name] if name in self.saved else {}
        out = {}
        for key in self.keys.get(name, tuple(saved)):
            if key in saved:
                old = saved[key]
                out[key] = grow_rows(old, t.num_embeddings, lambda a, b, old=old: old.new_zeros(b - a, *old.shape[1:]))
            else:  # never stepped before: what a fresh optimizer would hold ("sum" per row, moments per value)
                out[key] = torch.zeros(t.num_embeddings, *(() if key == "sum" else (t.embedding_dim,)))
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)
