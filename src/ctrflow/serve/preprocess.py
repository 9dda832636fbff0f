"""Raw Criteo fields as Triton BYTES tensors -> ranking-model inputs, with ctrflow's own transform."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Mapping

import numpy as np

from ctrflow.errors import UserError
from ctrflow.serve import RAW_INPUTS


def decode_fields(arrays: Mapping[str, np.ndarray | None]) -> dict[str, list[str]]:
    """Triton BYTES tensors ([B, 1] object arrays of bytes) -> {column: B strings}.

    A field absent from the request, rows of unequal count or bytes that are not UTF-8 raise
    `UserError` naming the field.
    """
    columns: dict[str, list[str]] = {}
    for name in RAW_INPUTS:
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


def preprocess_arrays(arrays: Mapping[str, np.ndarray | None], vocab) -> tuple[np.ndarray, np.ndarray]:
    """Raw field tensors -> (dense [B, 13] float32, sparse [B, 26] int64), as preprocessing computed them."""
    from ctrflow.preprocess.transform import transform_raw

    dense, sparse = transform_raw(decode_fields(arrays), vocab)
    return np.ascontiguousarray(dense, dtype=np.float32), np.ascontiguousarray(sparse, dtype=np.int64)


def copy_vocabularies(data: str | os.PathLike, model_dir: str | os.PathLike) -> Path:
    """Copy `data/vocab/` and `data/schema.json` into `model_dir`: what `load_vocabularies` reads."""
    data, model_dir = Path(data), Path(model_dir)
    shutil.copytree(data / "vocab", model_dir / "vocab", dirs_exist_ok=True)
    shutil.copy2(data / "schema.json", model_dir / "schema.json")
    return model_dir


def load_vocabularies(model_dir: str | os.PathLike):
    """The vocabularies `copy_vocabularies` put into a model version directory (`vocab/`, `schema.json`),
    checked against the schema's hash: ids from other vocabularies would silently mean other values."""
    from ctrflow.schema import Schema
    from ctrflow.preprocess.vocab import Vocabularies

    vocab = Vocabularies.load(model_dir)
    expected = Schema.load(model_dir).vocab_hash
    if vocab.hash() != expected:
        raise UserError(f"{model_dir}/vocab: vocabulary hash {vocab.hash()[:12]} != schema.json's {expected[:12]}")
    return vocab
