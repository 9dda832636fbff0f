"""Stream a processed split in file order, a record batch at a time (bounded memory at any size)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq

from ctrflow.errors import UserError
from ctrflow.contract.features import Features
from ctrflow.loaders.layout import RowLayout, check_columns, column_values, read_features

BATCH_ROWS = 1 << 18


def split_parts(data: str | os.PathLike, split: str) -> list[Path]:
    """`data/split/part-*.parquet` in order; UserError when there are none."""
    parts = sorted((Path(data) / split).glob("part-*.parquet"))
    if not parts:
        raise UserError(f"{Path(data) / split}: no part-*.parquet files (run `ctrflow preprocess` first)")
    return parts


def iter_split(parts: Sequence[Path], table_sizes: Sequence[int] | None = None, labels: bool = True,
               batch_rows: int = BATCH_ROWS, features: Features | None = None,
               ) -> Iterator[tuple[np.ndarray | None, np.ndarray, np.ndarray]]:
    """(labels [n] f32 or None, dense [n, num_dense] f32, sparse [n, slots] int64) per record batch,
    in row order (the feature contract `features`, by default the parts' dataset's schema.json:
    `parts` lie in `DATA/split/`).

    With `table_sizes` (one per sparse feature), ids outside their embedding table raise
    `UserError` naming file, row and feature.
    """
    from ctrflow.loaders.memory import check_ids

    if not parts:
        return
    layout = RowLayout(features if features is not None else read_features(Path(parts[0]).parent.parent))
    columns = [c for c in layout.columns if labels or c.kind != "label"]
    for part in parts:
        try:
            reader = pq.ParquetFile(part)
        except Exception as err:  # pyarrow raises several types for unreadable files
            raise UserError(f"{part}: cannot read Parquet ({err})") from None
        check_columns(part, reader.schema_arrow, layout, columns)
        offset = 0
        for batch in reader.iter_batches(batch_size=batch_rows, columns=[c.name for c in columns]):
            rows = batch.num_rows
            label, dense = None, np.empty((rows, layout.num_dense), np.float32)
            sparse = np.empty((rows, layout.slots), np.int64)
            for c in columns:
                values = column_values(str(part), batch.column(c.name), c)
                if c.kind == "label":
                    label = values.astype(np.float32, copy=False)
                elif c.kind == "dense":
                    dense[:, c.first - 1] = values
                else:
                    start = c.first - layout.first_id
                    sparse[:, start:start + c.width] = values.reshape(rows, c.width)
            if table_sizes is not None:
                where = f"{part} (rows counted from {offset})" if offset else str(part)
                check_ids(sparse, table_sizes, where=where, features=layout.features)
            offset += rows
            yield label, dense, sparse
