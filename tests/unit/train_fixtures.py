"""A tiny processed-data writer for train/loader/checkpoint tests: Parquet in the preprocess
layout with a learnable signal (labels drawn from a hidden logistic model over ids and dense)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ctrflow.schema import LABEL, Schema
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.datasets.criteo.columns import criteo_features


def write_processed(root: Path, train_rows: int = 4096, valid_rows: int = 2048, cardinality: int = 40,
                    seed: int = 0, parts: int = 2) -> Path:
    """Write `root/train/part-*.parquet`, `root/valid/part-*.parquet` and `root/schema.json`."""
    rng = np.random.default_rng(seed)
    id_weights = rng.normal(0.0, 1.0, size=(len(SPARSE), cardinality))
    dense_weights = rng.normal(0.0, 0.5, size=len(DENSE))
    for split, rows in (("train", train_rows), ("valid", valid_rows)):
        sparse = rng.integers(0, cardinality, size=(rows, len(SPARSE)), dtype=np.int32)
        dense = np.log1p(rng.exponential(3.0, size=(rows, len(DENSE)))).astype(np.float32)
        logits = 0.6 * id_weights[np.arange(len(SPARSE)), sparse].sum(axis=1) / np.sqrt(len(SPARSE)) * 3
        logits += (dense - dense.mean(0)) @ dense_weights - 1.0
        labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        (root / split).mkdir(parents=True, exist_ok=True)
        for k, rows_k in enumerate(np.array_split(np.arange(rows), parts)):
            columns = {LABEL: labels[rows_k], **{c: dense[rows_k, i] for i, c in enumerate(DENSE)},
                       **{c: sparse[rows_k, i] for i, c in enumerate(SPARSE)}}
            pq.write_table(pa.table(columns), root / split / f"part-{k:05d}.parquet")
    Schema(cardinalities={c: cardinality for c in SPARSE}, features=criteo_features({c: cardinality for c in SPARSE}),
           freq_threshold=1,
           rows={"train": train_rows, "valid": valid_rows}, vocab_hash=f"test-{seed}-{cardinality}").save(
        root / "schema.json")
    return root


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine, more threads spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
