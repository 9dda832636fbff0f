"""Checkpoint format 2: each table's weights and each of its optimizer state tensors in a file of its own.

Format 1 held every table in one `model.pt` and every table's optimizer state in one `optimizer.pt`,
so rank 0 assembled the whole model and all its state in host memory to write them (96 GB of tables
and 192 GB of lazy Adam moments at the MLPerf Criteo-1TB shape). Here every rank walks the tables in
one order (the gathers are collectives) and rank 0 writes each whole tensor as soon as it is
gathered and drops it before the next: its host memory is bounded by the largest table, not the
model. Each file is hashed while it is written (no second read of the checkpoint).

Layout inside a step directory (names listed in `meta.json` under "files", all in its sha256 map):
    tables/<collection path>.<table>.pt         whole weights [rows, D]
    table_state/<table>.<key>.pt                whole state ("sum" [rows]; "exp_avg", "exp_avg_sq" [rows, D])
Reading memory-maps one file at a time (`TableFiles`, `StateFiles`): a rank copies its shards' rows.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ctrflow.embedding.sharded import gathered_on_main
from ctrflow.errors import UserError
from ctrflow.models import embedding_collections



class OptimizerState(Protocol):
    """What a checkpoint reads and restores of a run's optimizers (`ctrflow.train.optim.Optimizers`)."""

    def header(self) -> dict[str, Any]: ...

    def state_keys(self, name: str) -> tuple[str, ...]: ...

    def whole_state(self, name: str, key: str) -> torch.Tensor | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

TABLES, STATE = "tables", "table_state"


class _HashingWriter:
    """A binary file that hashes what passes through (torch.save hands it memoryviews: no copy)."""

    def __init__(self, file):
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save_hashed(value: Any, path: Path) -> str:
    """`torch.save(value, path)`; returns the file's sha256 (computed on the way, not re-read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(value, writer)
        return writer.digest.hexdigest()


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU in storage of its own: torch.save writes a view's whole storage, and a
    fused collection's tables are views of one buffer (every file would hold every table)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def write_tables(model: nn.Module, optimizers: OptimizerState, tmp: Path | None) -> tuple[dict, dict[str, str]]:
    """Write every table's weights and optimizer state under `tmp`, one whole tensor at a time.

    Collective: every rank calls it (rank 0 with its temporary step directory, the others with None);
    under `gathered_on_main` only rank 0 assembles whole tensors. Returns ({"tables": {name: file},
    "table_state": {table: {key: file}}}, {file: sha256}), the same manifest on every rank.
    """
    files: dict[str, Any] = {TABLES: {}, STATE: {}}
    digests: dict[str, str] = {}

    def write(rel: str, whole: torch.Tensor) -> str:
        if tmp is not None:
            digests[rel] = save_hashed(compact(whole), tmp / rel)
        return rel

    with gathered_on_main():
        for path, collection in embedding_collections(model).items():
            for table in collection.tables:
                name = f"{path}.{table.name}"
                # the argument is the only reference: the whole table dies when `write` returns
                files[TABLES][name] = write(f"{TABLES}/{name}.pt", collection.full_table(table.name))
                files[STATE][table.name] = {}
                for key in optimizers.state_keys(table.name):
                    whole = optimizers.whole_state(table.name, key)
                    if whole is not None:
                        files[STATE][table.name][key] = write(f"{STATE}/{table.name}.{key}.pt", whole)
                    del whole
    return files, digests


def load_file(path: Path, mmap: bool = True) -> Any:
    """One checkpoint file, memory-mapped; a missing or unreadable file is a UserError naming it."""
    if not path.exists():
        raise UserError(f"{path}: missing from the checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(f"{path}: not a readable checkpoint file ({str(e).splitlines()[0]})") from e


class TableFiles(Mapping):
    """`{"<collection path>.<table>": whole weights}`, each memory-mapped from its file when asked for:
    a reader that takes one table at a time never maps two."""

    def __init__(self, step_dir: Path, files: dict[str, str]):
        self.step_dir, self.files = step_dir, files

    def __getitem__(self, name: str) -> torch.Tensor:
        return load_file(self.step_dir / self.files[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


class StateFiles(Mapping):
    """`{table: {key: whole state tensor}}`, memory-mapped per table when asked for."""

    def __init__(self, step_dir: Path, files: dict[str, dict[str, str]]):
        self.step_dir, self.files = step_dir, files

    def __getitem__(self, table: str) -> dict[str, torch.Tensor]:
        return {key: load_file(self.step_dir / rel) for key, rel in self.files[table].items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def read_model_state(step_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """`{"tables": whole tables by name, "dense": state_dict}` of a checkpoint of either format,
    memory-mapped (format 2: table by table, as the reader asks)."""
    if meta.get("format", 1) == 1:
        return load_file(step_dir / "model.pt")
    return {"dense": load_file(step_dir / "dense.pt"), "tables": TableFiles(step_dir, meta["files"][TABLES])}


def read_optimizer_state(step_dir: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What `Optimizers.load_state_dict` takes, from a checkpoint of either format, memory-mapped."""
    if meta.get("format", 1) == 1:
        return load_file(step_dir / "optimizer.pt")
    state = load_file(step_dir / "optimizer.pt")
    state["sparse"]["tables"] = StateFiles(step_dir, meta["files"][STATE])
    return state
