"""Raw Criteo fields → model inputs; the one implementation used by preprocess, predict and serving.

Dense: missing → 0, negative → 0, then log(1 + x), float32. Categorical: the vocabulary's ids
(0 missing, 1 rare/unseen, 2.. by descending training frequency).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ctrflow.datasets.criteo.raw import parse_integers
from ctrflow.preprocess.engines import CpuEngine, dense_inputs
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.preprocess.vocab import Vocabularies
from ctrflow.errors import UserError

_CPU = CpuEngine()


def transform_dense(columns: Sequence[pa.Array]) -> np.ndarray:
    """13 int64 columns (null = missing) → float32 [n, 13]: log1p(max(x, 0)), missing → 0
    (computed in float64, rounded once: the same bits on every engine)."""
    return np.ascontiguousarray(_CPU.transform_dense(dense_inputs(columns)).T)


def transform_raw(columns: Mapping[str, Sequence[str]], vocab: Vocabularies) -> tuple[np.ndarray, np.ndarray]:
    """Raw strings as in the TSV ("" or None = missing) for I1..I13 and C1..C26 →
    (dense float32 [N, 13], sparse int32 [N, 26]). A bad value raises `UserError` naming field and row."""
    absent = [c for c in (*DENSE, *SPARSE) if c not in columns]
    if absent:
        raise UserError(f"missing input field(s): {', '.join(absent)}")
    lengths = {c: len(columns[c]) for c in (*DENSE, *SPARSE)}
    n = lengths[DENSE[0]]
    uneven = [c for c, m in lengths.items() if m != n]
    if uneven:
        raise UserError(f"field {uneven[0]} has {lengths[uneven[0]]} rows, {DENSE[0]} has {n}")
    dense_columns = []
    for name in DENSE:
        values, bad = parse_integers(_strings(columns[name], name))
        if bad:
            raise UserError(f"field {name}, row {bad[0]}: not an integer: {_text(columns[name], bad[0])!r}")
        dense_columns.append(values)
    dense = transform_dense(dense_columns)
    sparse = np.empty((n, len(SPARSE)), dtype=np.int32)
    for j, name in enumerate(SPARSE):
        sparse[:, j] = vocab.encode(name, _strings(columns[name], name))
    return dense, sparse


def _strings(values: Sequence[str] | pa.Array, name: str) -> pa.Array:
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        array = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    else:
        items = values.tolist() if isinstance(values, np.ndarray) else list(values)
        items = [v.decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else v for v in items]
        try:
            array = pa.array(items, pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise UserError(f"field {name}: values must be strings ({err})") from None
    return pc.fill_null(array.cast(pa.string()), "")


def _text(values, index: int):
    value = values[index]
    return value.as_py() if isinstance(value, pa.Scalar) else value
