"""What changed between two versions of a model: the embedding rows (ids and new values, per table)
and the dense weights, with their size against the whole model.

Layout of `NAME_model/<k>/delta/`, written by `write_delta`:
    delta.json                 base and new version, per table: rows (new), base_rows, dim, changed
                               rows (added ones included), bytes; dense bytes; delta_bytes, full_bytes
    tables/<table>.ids.npy     int64 [n]: ids of the rows that differ from the base, or that the
                               base did not have (a grown vocabulary), ascending
    tables/<table>.values.npy  float32 [n, dim]: those rows' new values
    dense.npz                  every dense weight (they all move at every step)

`apply_delta(base, delta_dir)` rebuilds the new weights from the base's: a consumer that holds the
base version (a parameter server, an embedding cache) ships only the delta. Bytes are the arrays'
payload (ids, values, dense weights); `full_bytes` is every table and dense weight of the new model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ctrflow.errors import UserError

DELTA_DIR = "delta"


@dataclass
class TableDelta:
    """One table's changed rows: `ids` [n] and their new `values` [n, dim]."""

    rows: int  # rows of the new table
    base_rows: int
    ids: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        """Payload bytes: the ids and the rows."""
        return int(self.ids.nbytes + self.values.nbytes)


@dataclass
class Delta:
    """The change from a base model state to a new one (`ctrflow.checkpoint.model_state` layout)."""

    tables: dict[str, TableDelta]
    dense: dict[str, np.ndarray]
    full_bytes: int
    base_version: int | None = None
    version: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def dense_bytes(self) -> int:
        """Payload bytes of the dense weights."""
        return int(sum(v.nbytes for v in self.dense.values()))

    @property
    def nbytes(self) -> int:
        """Payload bytes of the whole delta."""
        return sum(t.nbytes for t in self.tables.values()) + self.dense_bytes

    def summary(self) -> dict:
        """The figures `delta.json` and the export's summary report."""
        changed = sum(len(t.ids) for t in self.tables.values())
        rows = sum(t.rows for t in self.tables.values())
        added = sum(max(t.rows - t.base_rows, 0) for t in self.tables.values())
        return {"base_version": self.base_version, "version": self.version,
                "changed_rows": changed, "added_rows": added, "total_rows": rows,
                "table_bytes": self.nbytes - self.dense_bytes, "dense_bytes": self.dense_bytes,
                "delta_bytes": self.nbytes, "full_bytes": self.full_bytes,
                "delta_fraction": self.nbytes / self.full_bytes if self.full_bytes else 0.0, **self.extra}


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


def compute_delta(base: dict, new: dict) -> Delta:
    """The delta from `base` to `new`, both `{"tables": {name: [rows, dim]}, "dense": {name: tensor}}`.

    A row counts as changed when any of its values differs (exactly: a row the optimizer did not
    touch keeps its bits); rows past the base's end are new. Tables must keep their names and
    widths (UserError naming the table otherwise).
    """
    tables, full = {}, 0
    for name, weight in new["tables"].items():
        after = _numpy(weight)
        full += after.nbytes
        if name not in base["tables"]:
            raise UserError(f"table {name}: not in the base version (its tables: {', '.join(sorted(base['tables']))})")
        before = _numpy(base["tables"][name])
        if before.shape[1:] != after.shape[1:]:
            raise UserError(f"table {name}: rows of width {after.shape[1:]} here, {before.shape[1:]} in the base version")
        common = min(len(before), len(after))
        changed = np.flatnonzero((before[:common] != after[:common]).reshape(common, -1).any(axis=1))
        ids = np.concatenate([changed, np.arange(common, len(after))]).astype(np.int64)
        tables[name] = TableDelta(rows=len(after), base_rows=len(before), ids=ids, values=after[ids])
    dense = {name: _numpy(value) for name, value in new["dense"].items()}
    full += sum(v.nbytes for v in dense.values())
    return Delta(tables=tables, dense=dense, full_bytes=full)


def write_delta(delta: Delta, out: str | os.PathLike) -> Path:
    """Write `delta` as `out/delta.json`, `out/tables/*.npy`, `out/dense.npz`; returns `out`."""
    out = Path(out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    record = delta.summary()
    record["tables"] = {}
    for name, table in delta.tables.items():
        np.save(out / "tables" / f"{name}.ids.npy", table.ids)
        np.save(out / "tables" / f"{name}.values.npy", table.values)
        record["tables"][name] = {"rows": table.rows, "base_rows": table.base_rows,
                                  "dim": int(table.values.shape[1]) if table.values.ndim > 1 else 1,
                                  "changed": int(len(table.ids)), "bytes": table.nbytes,
                                  "ids": f"tables/{name}.ids.npy", "values": f"tables/{name}.values.npy"}
    np.savez(out / "dense.npz", **delta.dense)
    record["dense"] = {"file": "dense.npz", "tensors": len(delta.dense), "bytes": delta.dense_bytes}
    (out / "delta.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


def read_delta_summary(delta_dir: str | os.PathLike) -> dict:
    """`delta.json` of a delta folder."""
    path = Path(delta_dir) / "delta.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not a readable delta ({err})") from None


def apply_delta(base: dict, delta_dir: str | os.PathLike) -> dict:
    """The new model state: `base` (`model_state` layout) with the delta in `delta_dir` applied.

    Each table is cut or grown to its new row count, then its changed rows are written; the dense
    weights are the delta's.
    """
    delta_dir = Path(delta_dir)
    record = read_delta_summary(delta_dir)
    tables = {}
    for name, meta in record["tables"].items():
        if name not in base["tables"]:
            raise UserError(f"{delta_dir}: table {name} is not in the base state")
        before = _numpy(base["tables"][name])
        if len(before) != meta["base_rows"]:
            raise UserError(f"{delta_dir}: table {name} has {len(before)} rows, the delta's base had {meta['base_rows']}")
        after = np.zeros((meta["rows"], *before.shape[1:]), dtype=before.dtype)
        keep = min(len(before), meta["rows"])
        after[:keep] = before[:keep]
        ids = np.load(delta_dir / meta["ids"])
        after[ids] = np.load(delta_dir / meta["values"])
        tables[name] = torch.from_numpy(after)
    with np.load(delta_dir / record["dense"]["file"]) as dense:
        return {"tables": tables, "dense": {k: torch.from_numpy(dense[k].copy()) for k in dense.files}}
