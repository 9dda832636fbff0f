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
import pyarrow.parquet as pq
import torch

from ctrflow.loaders.batch import Batch
from ctrflow.loaders.layout import (RowLayout, bad_id_message, check_columns, column_values, first_bad_ids,
                                    read_features)
from ctrflow.errors import UserError
from ctrflow.contract.features import Feature, Features


class ParquetDataset:
    """One split in host memory: `labels` [N] f32, `dense` [N, num_dense] f32, `sparse` [N, slots]
    int32 (the feature contract of `data_dir/schema.json`, or `features`; `ctrflow.loaders.layout`).

    With `table_sizes` (one per sparse feature), every id is checked against its table once, here
    on the CPU, so a bad id is reported by file, row and feature instead of as a device-side assert
    during lookup.
    """

    def __init__(self, data_dir: str | Path, split: str, table_sizes: Sequence[int] | None = None,
                 features: Features | None = None):
        self.files = sorted((Path(data_dir) / split).glob("part-*.parquet"))
        if not self.files:
            raise UserError(f"{Path(data_dir) / split}: no part-*.parquet files (run `ctrflow preprocess` first)")
        self.features = features if features is not None else read_features(data_dir)
        self.layout = RowLayout(self.features)
        labels, dense, sparse = [], [], []
        for path in self.files:
            lab, den, spa = _read_part(path, self.layout)
            if table_sizes is not None:
                check_ids(spa, table_sizes, where=str(path), features=self.features)
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


def _read_part(path: Path, layout: RowLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        check_columns(path, pq.read_schema(path), layout)
        table = pq.read_table(path, columns=layout.names)
    except UserError:
        raise
    except Exception as err:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: cannot read Parquet ({err})") from None
    rows = table.num_rows
    labels = np.empty(rows, np.float32)
    dense = np.empty((rows, layout.num_dense), np.float32)
    sparse = np.empty((rows, layout.slots), np.int32)
    for c in layout.columns:
        values = column_values(str(path), table.column(c.name), c)
        if not c.is_ids:
            (labels if c.kind == "label" else dense[:, c.first - 1])[:] = values
            continue
        bad = first_bad_ids(values, None)  # checked: nothing is truncated to 32 bits
        if bad is not None:
            raise UserError(bad_id_message(str(path), bad, c.name, values[bad], None))
        start = c.first - layout.first_id
        np.copyto(sparse[:, start:start + c.width], values.reshape(rows, c.width), casting="unsafe")
    return labels, dense, sparse


def check_ids(sparse: np.ndarray, table_sizes: Sequence[int], where: str = "batch",
              features: Features | Sequence[Feature] | None = None) -> None:
    """Raise `UserError` naming the feature and row of the first id outside [0, table size).

    `sparse` is [N, slots] with each sparse feature of `features` taking its `width` slots (without
    `features`: one slot per table, named by position); `table_sizes` has one entry per feature.
    """
    sparse_features = getattr(features, "sparse", features)
    if sparse_features is None:
        names, widths = [f"sparse feature {k}" for k in range(len(table_sizes))], [1] * len(table_sizes)
    else:
        names, widths = [f.name for f in sparse_features], [f.width for f in sparse_features]
    if len(names) != len(table_sizes) or sparse.ndim != 2 or sparse.shape[1] != sum(widths):
        raise UserError(f"{where}: expected ids of shape [rows, {sum(widths)}] for {len(names)} sparse "
                        f"feature(s), got {list(sparse.shape)}")
    sizes = np.repeat(np.asarray(table_sizes, dtype=np.int64), widths)  # [slots]
    bad = (sparse < 0) | (sparse >= sizes)  # [N, slots]
    if not bad.any():
        return
    row, slot = (int(i) for i in np.argwhere(bad)[0])
    feature = int(np.searchsorted(np.cumsum(widths), slot, side="right"))
    raise UserError(bad_id_message(where, row, names[feature], sparse[row, slot], int(sizes[slot])))


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
