"""Where categorify and the dense transform run: numpy on the CPU, torch on a device, or cuDF.

Every engine gets the same inputs from the CPU parser (uint64 keys of 8-byte values, int64 dense
columns) and must give bit-identical results, so the output is the same whatever the hardware:
value counts are exact integers, lookups are exact matches against the same sorted vocabulary,
and the dense transform is computed in float64 and rounded once to float32 (a correctly rounded
result, identical across numpy, torch CPU and CUDA). The slow path for other strings stays on the CPU.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.data.schema import OOV_ID
from ctrflow.errors import UserError

ENGINES = ("cpu", "torch", "gpu", "cudf")
CUDF_HINT = "cudf engine needs the `gpu` extra (cudf-cu12) and a CUDA GPU"


LOG1P_TABLE_SIZE = 1 << 16
# log1p of the small integers (most dense values), each computed in float64 and rounded once
_LOG1P_TABLE = np.log1p(np.arange(LOG1P_TABLE_SIZE, dtype=np.float64)).astype(np.float32)
_DEVICE_TABLES: dict = {}  # the table on an engine's device, copied there once per process


def dense_inputs(columns: Sequence[pa.Array | pa.ChunkedArray]) -> np.ndarray:
    """13 int64 columns (null = missing) → int64 [13, n] (column-major), missing → 0."""
    n = len(columns[0]) if columns else 0
    out = np.empty((len(columns), n), dtype=np.int64)
    for j, column in enumerate(columns):
        out[j] = pc.fill_null(column, 0).to_numpy(zero_copy_only=False)
    return out


class CpuEngine:
    """numpy: sort-based counting, hash lookup (pandas), float64 log1p."""

    name = "cpu"

    def unique_counts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(distinct non-zero uint64 keys, int64 counts), in any order."""
        values, counts = np.unique(keys[keys != 0], return_counts=True)
        return values, counts.astype(np.int64)

    def factorize(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(codes int32 [n], distinct uint64 keys [u]) with keys == uniques[codes] (hash-based)."""
        import pandas as pd

        codes, uniques = pd.factorize(keys)
        return codes.astype(np.int32), np.asarray(uniques, dtype=np.uint64)

    def transform_dense(self, raw: np.ndarray) -> np.ndarray:
        """int64 (any shape) → float32, same shape: log1p(max(x, 0)); small values from a table."""
        clipped = np.clip(raw, 0, LOG1P_TABLE_SIZE - 1)
        out = _LOG1P_TABLE[clipped]
        large = raw >= LOG1P_TABLE_SIZE
        if large.any():
            out[large] = np.log1p(raw[large].astype(np.float64)).astype(np.float32)
        return out

    def lookup(self, table: "KeyTable", keys: np.ndarray) -> np.ndarray:
        """Ids (int32) of uint64 keys: the vocabulary's id, or OOV_ID when absent."""
        return table.ids[table.index.get_indexer(keys)]  # -1 picks the last entry, OOV_ID


class KeyTable:
    """One column's 8-byte vocabulary keys and their ids, ready for an engine's lookup."""

    def __init__(self, keys: np.ndarray, ids: np.ndarray):
        import pandas as pd

        self.index = pd.Index(keys)
        self.ids = np.append(ids, OOV_ID).astype(np.int32)
        order = np.argsort(keys.view(np.int64), kind="stable")
        self.sorted_keys, self.sorted_ids = keys.view(np.int64)[order], ids[order].astype(np.int32)
        self.device_tables: dict = {}  # per engine: the sorted keys and ids on its device


class TorchEngine:
    """torch on a device (cuda or cpu): torch.unique counting, sorted-key searchsorted lookup."""

    name = "torch"

    def __init__(self, device: str = "cuda"):
        try:
            import torch
        except ImportError:
            raise UserError("torch engine needs torch installed") from None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--engine torch --device {device}: no CUDA GPU visible here (use --device cpu)")
        self.torch, self.device = torch, torch.device(device)

    def _to(self, array: np.ndarray):
        array = np.ascontiguousarray(array)
        if not array.flags.writeable:  # e.g. a view of an Arrow buffer; torch wants writable memory
            array = array.copy()
        return self.torch.from_numpy(array).to(self.device)

    def unique_counts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(distinct non-zero uint64 keys, int64 counts), in any order."""
        signed = self._to(keys.view(np.int64))  # same bits: uniqueness does not care about the sign
        values, counts = self.torch.unique(signed[signed != 0], sorted=True, return_counts=True)
        return values.cpu().numpy().view(np.uint64), counts.cpu().numpy().astype(np.int64)

    def factorize(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(codes int32 [n], distinct uint64 keys [u]) with keys == uniques[codes] (sort-based)."""
        uniques, codes = self.torch.unique(self._to(keys.view(np.int64)), sorted=True, return_inverse=True)
        return codes.to(self.torch.int32).cpu().numpy(), uniques.cpu().numpy().view(np.uint64)

    def transform_dense(self, raw: np.ndarray) -> np.ndarray:
        """int64 (any shape) → float32, same shape: the CPU engine's table, log1p in float64 beyond it."""
        if self.name not in _DEVICE_TABLES:
            _DEVICE_TABLES[self.name] = self._to(_LOG1P_TABLE)
        x = self._to(raw)
        out = _DEVICE_TABLES[self.name][x.clamp(0, LOG1P_TABLE_SIZE - 1)]
        large = x >= LOG1P_TABLE_SIZE
        out[large] = self.torch.log1p(x[large].to(self.torch.float64)).to(self.torch.float32)
        return out.cpu().numpy()

    def lookup(self, table: KeyTable, keys: np.ndarray) -> np.ndarray:
        """Ids (int32) of uint64 keys: the vocabulary's id, or OOV_ID when absent."""
        if self.name not in table.device_tables:
            table.device_tables[self.name] = (self._to(table.sorted_keys), self._to(table.sorted_ids))
        sorted_keys, sorted_ids = table.device_tables[self.name]
        if len(sorted_keys) == 0:
            return np.full(len(keys), OOV_ID, dtype=np.int32)
        signed = self._to(keys.view(np.int64))
        pos = self.torch.searchsorted(sorted_keys, signed).clamp_(max=len(sorted_keys) - 1)
        hit = sorted_keys[pos] == signed
        ids = self.torch.where(hit, sorted_ids[pos], self.torch.full_like(sorted_ids[pos], OOV_ID))
        return ids.cpu().numpy()


class CudfEngine(CpuEngine):
    """cuDF on the GPU: value counts and lookup as cuDF joins (needs the `gpu` extra)."""

    name = "cudf"

    def __init__(self, device: str = "cuda"):
        try:
            import cudf
        except ImportError as err:
            raise UserError(f"{CUDF_HINT}: cannot import cudf ({err})") from None
        except Exception as err:  # cuDF raises various errors when no GPU or driver is usable
            raise UserError(f"{CUDF_HINT}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        self.cudf = cudf

    def unique_counts(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(distinct non-zero uint64 keys, int64 counts), in any order."""
        series = self.cudf.Series(keys[keys != 0].view(np.int64))
        counts = series.value_counts()
        return counts.index.to_numpy().view(np.uint64), counts.to_numpy().astype(np.int64)

    def factorize(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(codes int32 [n], distinct uint64 keys [u]) with keys == uniques[codes]."""
        codes, uniques = self.cudf.Series(keys.view(np.int64)).factorize()
        return codes.get().astype(np.int32), uniques.to_numpy().view(np.uint64)

    def lookup(self, table: KeyTable, keys: np.ndarray) -> np.ndarray:
        """Ids (int32) of uint64 keys: the vocabulary's id, or OOV_ID when absent."""
        if self.name not in table.device_tables:
            table.device_tables[self.name] = self.cudf.Series(table.sorted_keys)
        sorted_keys = table.device_tables[self.name]
        signed = self.cudf.Series(keys.view(np.int64))
        pos = np.minimum(sorted_keys.searchsorted(signed).get(), max(0, len(table.sorted_keys) - 1))
        hit = table.sorted_keys[pos] == keys.view(np.int64) if len(table.sorted_keys) else np.zeros(len(keys), bool)
        return np.where(hit, table.sorted_ids[pos] if len(table.sorted_keys) else OOV_ID, OOV_ID).astype(np.int32)


def make_engine(name: str = "cpu", device: str = "cuda"):
    """The engine called `name` ("cpu", "torch" or "gpu" on `device`, "cudf"); a clear UserError where it cannot run."""
    if name == "cpu":
        return CpuEngine()
    if name in ("torch", "gpu"):  # "gpu" parses on the device in `gpu_engine`; per-block stages use torch
        return TorchEngine(device)
    if name == "cudf":
        return CudfEngine(device)
    raise UserError(f"--engine must be one of {', '.join(ENGINES)}, got {name!r}")
