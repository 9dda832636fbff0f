"""Raw columns as Triton BYTES tensors -> ranking-model inputs, with ctrflow's own transform.

The preprocessing model's version directory holds `schema.json` (the feature contract and the
dataset description) and `vocab/`; `transform_raw` turns the raw text of each column (a number, a
category, a separated multi-hot list; "" = missing) into the ids and values preprocessing wrote.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ctrflow.errors import UserError
from ctrflow.serve import raw_inputs


def decode_fields(arrays: Mapping[str, np.ndarray | None], names: Sequence[str]) -> dict[str, list[str]]:
    """Triton BYTES tensors ([B, 1] object arrays of bytes) -> {column: B strings}, for `names`.

    A field absent from the request, rows of unequal count or bytes that are not UTF-8 raise
    `UserError` naming the field.
    """
    columns: dict[str, list[str]] = {}
    for name in names:
        values = arrays.get(name)
        if values is None:
            raise UserError(f"field {name}: missing from the request")
        flat = np.asarray(values, dtype=object).reshape(-1)
        try:
            columns[name] = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat]
        except UnicodeDecodeError as err:
            raise UserError(f"field {name}: not UTF-8 text ({err.reason})") from None
    counts = {len(v) for v in columns.values()}
    if len(counts) > 1:
        raise UserError(f"fields hold different numbers of rows: {sorted(counts)}")
    return columns


def transform_columns(columns: Mapping[str, Sequence[str]], schema, vocab) -> tuple[np.ndarray, np.ndarray]:
    """Raw text per column -> (dense [N, num_dense] float32, sparse [N, slots] int64), as
    preprocessing computed them (`ctrflow.contract.transform.transform_raw`)."""
    from ctrflow.contract.transform import transform_raw

    dense, sparse = transform_raw(columns, schema, vocab)
    return np.ascontiguousarray(dense, dtype=np.float32), np.ascontiguousarray(sparse, dtype=np.int64)


def preprocess_arrays(arrays: Mapping[str, np.ndarray | None], schema, vocab) -> tuple[np.ndarray, np.ndarray]:
    """Raw field tensors -> (dense [B, num_dense] float32, sparse [B, slots] int64)."""
    return transform_columns(decode_fields(arrays, raw_inputs(schema)), schema, vocab)


def copy_vocabularies(data: str | os.PathLike, model_dir: str | os.PathLike) -> Path:
    """Copy `data/vocab/` and `data/schema.json` into `model_dir`: what `load_preprocessing` reads."""
    data, model_dir = Path(data), Path(model_dir)
    shutil.copytree(data / "vocab", model_dir / "vocab", dirs_exist_ok=True)
    shutil.copy2(data / "schema.json", model_dir / "schema.json")
    return model_dir


def load_preprocessing(model_dir: str | os.PathLike):
    """(schema, vocabularies) that `copy_vocabularies` put into `model_dir`, the vocabularies
    checked against the schema's hash: ids from other vocabularies would silently mean other values."""
    from ctrflow.contract.vocab import Vocabularies
    from ctrflow.contract.schema import Schema

    schema = Schema.load(model_dir)
    vocab = Vocabularies.load(model_dir)
    if vocab.hash() != schema.vocab_hash:
        raise UserError(f"{model_dir}/vocab: vocabulary hash {vocab.hash()[:12]} != schema.json's "
                        f"{schema.vocab_hash[:12]}")
    return schema, vocab
