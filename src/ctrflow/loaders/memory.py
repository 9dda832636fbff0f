"""Processed Parquet -> `Batch`es: seeded shuffling, rank slicing, background prefetch.

A split (`DIR/train/part-*.parquet`) is read once into host memory as column arrays. The
sequence of *global* batches depends only on (seed, epoch): an epoch is a seeded permutation of
all rows, cut into `batch_size` rows per global batch. Process `rank` of `world_size` takes rows
[len*r/W, len*(r+1)/W) of each global batch, so any number of processes sees the same global
batches. The position (epoch, batch index) is all a resumed run needs.

With `device`, the split is copied to that device once (`resident_bytes` says how much) and each
batch is an index_select there by the epoch's permutation: no host work per batch, no copy. Else
batches are gathered on the host by a background thread (pinned for an asynchronous copy).

This path reads the whole split into host memory; splits that do not fit are streamed by
`ctrflow.loaders.stream.StreamLoader` (`ctrflow train --loader auto|memory|stream`). Evaluation and
validation read in order, with bounded memory, through `ctrflow.loaders.scan.ScanLoader`.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ctrflow.loaders.batch import Batch
from ctrflow.schema import LABEL
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.errors import UserError

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


class ParquetDataset:
    """One split in host memory: `labels` [N] f32, `dense` [N, 13] f32, `sparse` [N, 26] int32.

    With `table_sizes`, every id is checked against its table once, here on the CPU, so a bad id
    is reported by file, row and feature instead of as a device-side assert during lookup.
    """

    def __init__(self, data_dir: str | Path, split: str, table_sizes: Sequence[int] | None = None):
        self.files = sorted((Path(data_dir) / split).glob("part-*.parquet"))
        if not self.files:
            raise UserError(f"{Path(data_dir) / split}: no part-*.parquet files (run `ctrflow preprocess` first)")
        labels, dense, sparse = [], [], []
        for path in self.files:
            lab, den, spa = _read_part(path)
            if table_sizes is not None:
                check_ids(spa, table_sizes, where=str(path))
            labels.append(lab)
            dense.append(den)
            sparse.append(spa)
        self.labels = np.concatenate(labels)
        self.dense = np.concatenate(dense)
        self.sparse = np.concatenate(sparse)

    def __len__(self) -> int:
        return len(self.labels)

    def resident_bytes(self) -> int:
        """Bytes of the split kept on a device (ids as int32)."""
        return self.labels.nbytes + self.dense.nbytes + self.sparse.nbytes


def _read_part(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: cannot read Parquet ({err})") from None
    missing = [c for c in (LABEL, *DENSE, *SPARSE) if c not in table.column_names]
    if missing:
        raise UserError(f"{path}: missing column(s) {', '.join(missing)}")

    def column(name: str, dtype) -> np.ndarray:
        values = table.column(name)
        if values.null_count:
            raise UserError(f"{path}: column {name} has {values.null_count} null value(s)")
        return values.to_numpy().astype(dtype, copy=False)

    def ids(name: str) -> np.ndarray:
        values = column(name, np.int64)
        kind = table.schema.field(name).type
        wide = pa.types.is_integer(kind) and (kind.bit_width > 32 or pa.types.is_uint32(kind))
        if wide and len(values) and (values.min() < INT32_MIN or values.max() > INT32_MAX):
            row = int(np.argmax((values < INT32_MIN) | (values > INT32_MAX)))
            raise UserError(f"{path}: row {row}: {name} id {int(values[row])} does not fit in 32 bits (was the "
                            f"data written by `ctrflow preprocess`?)")
        return values

    labels = column(LABEL, np.float32)
    dense = np.stack([column(c, np.float32) for c in DENSE], axis=1)
    sparse = np.stack([ids(c) for c in SPARSE], axis=1).astype(np.int32)  # checked: nothing truncated
    return labels, dense, sparse


def check_ids(sparse: np.ndarray, table_sizes: Sequence[int], where: str = "batch") -> None:
    """Raise `UserError` naming the feature and row of the first id outside [0, table size)."""
    sizes = np.asarray(table_sizes, dtype=np.int64)
    bad = (sparse < 0) | (sparse >= sizes)  # [N, 26]
    if not bad.any():
        return
    row, col = (int(i) for i in np.argwhere(bad)[0])
    raise UserError(
        f"{where}: row {row}: {SPARSE[col]} id {int(sparse[row, col])} is outside its embedding table "
        f"of {int(sizes[col])} rows (ids must be in [0, {int(sizes[col])}); does the data match schema.json?)"
    )


class BatchLoader:
    """Iterates one process's share of the global batches of a `ParquetDataset`.

    Training: `shuffle=True, drop_last=True`; evaluation: in order, the last partial batch kept.
    """

    def __init__(self, dataset: ParquetDataset, batch_size: int, *, shuffle: bool, drop_last: bool,
                 seed: int = 0, rank: int = 0, world_size: int = 1, pin_memory: bool = False,
                 prefetch: int = 4, limit_batches: int | None = None, device: torch.device | str | None = None):
        if drop_last and batch_size % world_size:
            raise UserError(f"--batch-size {batch_size} must be divisible by the {world_size} processes")
        if batch_size <= 0:
            raise UserError(f"--batch-size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.rank, self.world_size = rank, world_size
        self.pin_memory, self.prefetch, self.limit_batches = pin_memory, prefetch, limit_batches
        self.device = None if device is None else torch.device(device)
        self._resident = None
        if self.device is not None:  # one host-to-device copy of the whole split
            self._resident = tuple(torch.from_numpy(a).to(self.device)
                                   for a in (dataset.dense, dataset.sparse, dataset.labels))

    def __len__(self) -> int:
        """Global batches per epoch."""
        n = len(self.dataset)
        count = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return count if self.limit_batches is None else min(count, self.limit_batches)

    def order(self, epoch: int) -> np.ndarray | None:
        """The epoch's row order: a permutation seeded by (seed, epoch), or None for file order."""
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def rows(self, order: np.ndarray | torch.Tensor | None, index: int) -> np.ndarray | torch.Tensor | slice:
        """This process's rows of global batch `index`."""
        start = index * self.batch_size
        stop = min(start + self.batch_size, len(self.dataset))
        size = stop - start
        lo = start + size * self.rank // self.world_size
        hi = start + size * (self.rank + 1) // self.world_size
        return slice(lo, hi) if order is None else order[lo:hi]

    def resident_batch(self, rows: torch.Tensor | slice) -> Batch:
        """Gather rows of the device-resident split (`rows`: a device index tensor or a slice)."""
        dense, sparse, labels = self._resident
        if isinstance(rows, slice):
            return Batch(dense[rows], sparse[rows].long(), labels[rows])
        return Batch(dense.index_select(0, rows), sparse.index_select(0, rows).long(), labels.index_select(0, rows))

    def batch(self, rows: np.ndarray | slice) -> Batch:
        """Gather rows into a `Batch` (ids widened to int64 for lookups)."""
        data = self.dataset
        batch = Batch(torch.from_numpy(np.ascontiguousarray(data.dense[rows])),
                      torch.from_numpy(data.sparse[rows].astype(np.int64)),
                      torch.from_numpy(np.ascontiguousarray(data.labels[rows])))
        return batch.pin_memory() if self.pin_memory else batch

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """Global batches `start`, `start + 1`, ... of `epoch`, prepared by a background thread."""
        order = self.order(epoch)
        indices = range(start, len(self))
        if self._resident is not None:  # kernels queue on the device: nothing to overlap on the host
            order = None if order is None else torch.from_numpy(order).to(self.device)
            yield from (self.resident_batch(self.rows(order, i)) for i in indices)
            return
        if self.prefetch <= 0:
            yield from (self.batch(self.rows(order, i)) for i in indices)
            return
        yield from _prefetch((self.batch(self.rows(order, i)) for i in indices), self.prefetch)


_DONE = object()


def _prefetch(items: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """Run `items` in a daemon thread, `depth` ahead; errors surface in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put(item)
            q.put(_DONE)
        except BaseException as err:  # handed to the consumer, which re-raises it
            q.put(err)

    thread = threading.Thread(target=produce, name="ctrflow-loader", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass
