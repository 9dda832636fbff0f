"""Which rows the streaming loader reads, and in what order: row groups, lanes, shuffle windows.

A split is a list of *pieces* (the Parquet row groups of `DIR/split/part-*.parquet`), known from
the files' footers alone. An epoch's plan depends only on (seed, epoch):

- the pieces are put in a seeded order (file order when not shuffling) and seen as one stream of
  `N` rows;
- the stream is cut into `L` *lanes* of N/L consecutive rows (lane boundaries may fall inside a
  row group; each lane then reads only its rows of it);
- each lane is cut into *windows* of `window` rows (a multiple of the lane's batch share
  `b = B / L`); a window's rows are permuted by a permutation seeded by (seed, epoch, lane, window);
- global batch i is the union over lanes l of rows [i*b, (i+1)*b) of lane l's permuted stream.

An epoch has floor(N/B) global batches, as the in-memory loader's; each lane drops its last
(N/L mod b) rows, fewer than B + L rows in all. A process of rank r among W (W divides L) owns
lanes r, r+W, ...: it reads only those, ~1/W of the split, and the union of the W processes'
batches is the same set of rows for every such W.

Evaluation's `ScanPlan` is the same stream in file order, unshuffled: a row range [begin, end)
(one process's share) in windows of whole batches, nothing dropped.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ctrflow.errors import UserError
from ctrflow.contract.features import Features
from ctrflow.loaders.layout import RowLayout, check_columns, column_values, read_features


class ParquetIndex:
    """The row groups of one split, from the files' footers only (no column data is read).

    Arrays, one entry per non-empty row group ("piece"): `piece_file` (index into `files`),
    `piece_group` (row group within the file), `piece_rows`, `piece_first_row` (within the file).
    A file that cannot be opened, a missing column or a non-integer id column is a `UserError`.
    The columns are those of the feature contract (`data_dir/schema.json`'s, or `features`): `layout`
    (`ctrflow.loaders.layout.RowLayout`) says where each lands in a row of 32-bit words.
    """

    def __init__(self, data_dir: str | Path, split: str, threads: int = 8, features: Features | None = None):
        self.files = sorted((Path(data_dir) / split).glob("part-*.parquet"))
        if not self.files:
            raise UserError(f"{Path(data_dir) / split}: no part-*.parquet files (run `ctrflow preprocess` first)")
        self.layout = RowLayout(features if features is not None else read_features(data_dir))
        with ThreadPoolExecutor(max(1, threads)) as pool:
            group_rows = list(pool.map(lambda path: _footer_rows(path, self.layout), self.files))
        file_index, groups, rows, first = [], [], [], []
        for i, counts in enumerate(group_rows):
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            for g, (n, s) in enumerate(zip(counts, starts)):
                if n:
                    file_index.append(i), groups.append(g), rows.append(n), first.append(int(s))
        self.piece_file = np.asarray(file_index, np.int64)
        self.piece_group = np.asarray(groups, np.int64)
        self.piece_rows = np.asarray(rows, np.int64)
        self.piece_first_row = np.asarray(first, np.int64)
        self.rows = int(self.piece_rows.sum())

    def __len__(self) -> int:
        return self.rows

    def resident_bytes(self) -> int:
        """Bytes the whole split would take in memory (`layout.row_bytes` a row: 160 for Criteo), as
        `ParquetDataset.resident_bytes`."""
        return len(self) * self.layout.row_bytes

    def where(self, piece: int) -> str:
        """`"FILE: row group G"` for messages."""
        return f"{self.files[self.piece_file[piece]]}: row group {self.piece_group[piece]}"

    def read(self, piece: int) -> dict[str, np.ndarray]:
        """One row group's columns as numpy arrays, [n] or [n, max_length] for a multi-hot column
        (zero-copy views where the types allow)."""
        path = self.files[self.piece_file[piece]]
        try:
            table = pq.ParquetFile(path).read_row_group(int(self.piece_group[piece]), columns=self.layout.names,
                                                        use_threads=False)
        except Exception as err:  # pyarrow raises several types for unreadable data
            raise UserError(f"{self.where(piece)}: cannot read Parquet ({err})") from None
        return {c.name: column_values(self.where(piece), table.column(c.name), c) for c in self.layout.columns}


def _footer_rows(path: Path, layout: RowLayout) -> list[int]:
    """Rows of each row group of `path`; checks that every column is there with a usable type."""
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise UserError(f"{path}: cannot read Parquet ({err})") from None
    check_columns(path, parquet.schema_arrow, layout)
    meta = parquet.metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


class _RowStream:
    """The split's pieces in `order`, seen as one stream of rows; `reads` maps a row range to pieces."""

    def __init__(self, index: ParquetIndex, order: np.ndarray):
        self.index, self.order = index, order
        self.starts = np.concatenate([[0], np.cumsum(index.piece_rows[order])])  # stream offsets

    def reads(self, begin: int, end: int) -> list[tuple[int, int, int, int]]:
        """The reads that cover stream rows [begin, end): (piece, first row, end row within the
        piece, position from `begin`), in stream order."""
        k = int(np.searchsorted(self.starts, begin, side="right")) - 1
        out = []
        while k < len(self.order) and self.starts[k] < end:
            lo, hi = max(begin, self.starts[k]), min(end, self.starts[k + 1])
            out.append((int(self.order[k]), int(lo - self.starts[k]), int(hi - self.starts[k]), int(lo - begin)))
            k += 1
        return out


class EpochPlan(_RowStream):
    """Where each lane's windows come from in one epoch (module doc); no data is read here."""

    indexed = True  # batches are gathered by a permuted index

    def __init__(self, index: ParquetIndex, batch_size: int, lanes: int, window_rows: int, seed: int,
                 epoch: int, shuffle: bool):
        pieces = len(index.piece_rows)
        super().__init__(index, np.random.default_rng([seed, epoch]).permutation(pieces) if shuffle
                         else np.arange(pieces))
        self.lanes, self.seed, self.epoch, self.shuffle = lanes, seed, epoch, shuffle
        self.lane_batch = batch_size // lanes  # b: each lane's rows of a global batch
        total = len(index)
        self.batches = (total // lanes) // self.lane_batch
        # batches per window: the window is a whole number of lane batches, at least one
        self.window_batches = max(1, min(window_rows // lanes // self.lane_batch, self.batches))
        self.window = self.window_batches * self.lane_batch  # rows per lane window
        self.windows = -(-self.batches // self.window_batches)
        self.lane_starts = [total * lane // lanes for lane in range(lanes)]

    def window_size(self, window: int) -> int:
        """Rows of each lane in `window` (the last window may be shorter; always a multiple of b)."""
        return min(self.window, self.batches * self.lane_batch - window * self.window)

    def tasks(self, window: int, lane: int) -> list[tuple[int, int, int, int]]:
        """The reads that fill `lane`'s `window`: (piece, first row, end row within the piece,
        position in the window), in stream order."""
        begin = self.lane_starts[lane] + window * self.window
        return self.reads(begin, begin + self.window_size(window))

    def permutation(self, window: int, lane: int) -> np.ndarray:
        """The order of `lane`'s `window` rows: seeded by (seed, epoch, lane, window); identity when
        not shuffling."""
        size = self.window_size(window)
        if not self.shuffle:
            return np.arange(size, dtype=np.int64)
        return np.random.default_rng([self.seed, self.epoch, lane, window]).permutation(size)


class ScanPlan(_RowStream):
    """Rows [begin, end) of the split in file order, in windows of whole batches of `batch` rows:
    evaluation's plan (one lane, nothing dropped or permuted; the last batch may be short)."""

    indexed = False  # batches are spans of the window

    def __init__(self, index: ParquetIndex, batch: int, window_rows: int, begin: int, end: int):
        super().__init__(index, np.arange(len(index.piece_rows)))
        self.begin, self.rows, self.lane_batch = begin, max(0, end - begin), batch
        self.batches = -(-self.rows // batch)
        self.window_batches = max(1, min(window_rows // batch, self.batches))
        self.window = self.window_batches * batch
        self.windows = -(-self.batches // self.window_batches)

    def window_size(self, window: int) -> int:
        """Rows in `window` (the last one may be shorter, and not a whole number of batches)."""
        return max(0, min(self.window, self.rows - window * self.window))

    def tasks(self, window: int, lane: int = 0) -> list[tuple[int, int, int, int]]:
        """The reads that fill `window` (as `EpochPlan.tasks`; `lane` is always 0)."""
        begin = self.begin + window * self.window
        return self.reads(begin, begin + self.window_size(window))
