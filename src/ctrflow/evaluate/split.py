"""Stream a processed split in file order, a record batch at a time (bounded memory at any size)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq

from ctrflow.schema import LABEL
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.errors import UserError

BATCH_ROWS = 1 << 18


def split_parts(data: str | os.PathLike, split: str) -> list[Path]:
    """`data/split/part-*.parquet` in order; UserError when there are none."""
    parts = sorted((Path(data) / split).glob("part-*.parquet"))
    if not parts:
        raise UserError(f"{Path(data) / split}: no part-*.parquet files (run `ctrflow preprocess` first)")
    return parts


def _column(batch, name: str, dtype, part: Path) -> np.ndarray:
    values = batch.column(name)
    if values.null_count:
        raise UserError(f"{part}: column {name} has {values.null_count} null value(s)")
    return values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def iter_split(parts: Sequence[Path], table_sizes: Sequence[int] | None = None, labels: bool = True,
               batch_rows: int = BATCH_ROWS) -> Iterator[tuple[np.ndarray | None, np.ndarray, np.ndarray]]:
    """(labels [n] f32 or None, dense [n, 13] f32, sparse [n, 26] int64) per record batch, in row order.

    With `table_sizes`, ids outside their embedding table raise `UserError` naming file and column.
    """
    from ctrflow.loaders.memory import check_ids

    columns = [*([LABEL] if labels else []), *DENSE, *SPARSE]
    for part in parts:
        try:
            reader = pq.ParquetFile(part)
        except Exception as err:  # pyarrow raises several types for unreadable files
            raise UserError(f"{part}: cannot read Parquet ({err})") from None
        missing = [c for c in columns if c not in reader.schema_arrow.names]
        if missing:
            raise UserError(f"{part}: missing column(s) {', '.join(missing)}")
        offset = 0
        for batch in reader.iter_batches(batch_size=batch_rows, columns=columns):
            dense = np.stack([_column(batch, c, np.float32, part) for c in DENSE], axis=1)
            sparse = np.stack([_column(batch, c, np.int64, part) for c in SPARSE], axis=1)
            if table_sizes is not None:
                check_ids(sparse, table_sizes, where=f"{part} (rows counted from {offset})" if offset else str(part))
            offset += batch.num_rows
            yield (_column(batch, LABEL, np.float32, part) if labels else None), dense, sparse
