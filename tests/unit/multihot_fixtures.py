"""Processed data with any feature set, written straight in the processed layout: dense, categorical
and multi-hot features (0-padded `fixed_size_list<int32>` columns), a schema.json carrying the
features, and labels from a hidden logistic model over the ids and the dense values (learnable)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ctrflow.features import LABEL, Feature, Features
from ctrflow.schema import Schema


def mixed_features(dense: int = 2, categorical: int = 2, multi_hot: int = 2, cardinality: int = 30,
                   max_length: int = 4) -> Features:
    """`dense` dense features (d0..), `categorical` one-id features (c0..), `multi_hot` bags (m0..:
    alternately sum and mean pooled, max lengths `max_length`, `max_length` + 1, ...)."""
    return Features(
        dense=tuple(Feature(f"d{i}", "dense", transform="log1p") for i in range(dense)),
        sparse=(*(Feature(f"c{i}", "categorical", cardinality=cardinality + i) for i in range(categorical)),
                *(Feature(f"m{i}", "multi_hot", cardinality=cardinality + 3 * i, max_length=max_length + i,
                          pooling=("sum", "mean")[i % 2]) for i in range(multi_hot))))


def draw_rows(features: Features, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(dense [rows, num_dense] f32, sparse [rows, slots] int32): multi-hot bags of 0..max_length ids
    (some empty), their padding (id 0) after the ids as preprocess writes them."""
    dense = np.log1p(rng.exponential(3.0, size=(rows, features.num_dense))).astype(np.float32)
    parts = []
    for f in features.sparse:
        if f.kind == "categorical":
            parts.append(rng.integers(0, f.cardinality, size=(rows, 1)))
            continue
        ids = rng.integers(1, f.cardinality, size=(rows, f.max_length))
        lengths = rng.integers(0, f.max_length + 1, size=rows)
        ids[np.arange(f.max_length)[None, :] >= lengths[:, None]] = 0
        parts.append(ids)
    sparse = np.concatenate(parts, axis=1).astype(np.int32) if parts else np.zeros((rows, 0), np.int32)
    return dense, sparse


def write_split(root: Path, split: str, features: Features, dense: np.ndarray, sparse: np.ndarray,
                labels: np.ndarray, parts: int = 2, row_group_size: int | None = None) -> None:
    """`root/split/part-*.parquet` in the processed layout (`ctrflow.features`)."""
    (root / split).mkdir(parents=True, exist_ok=True)
    for k, rows in enumerate(np.array_split(np.arange(len(labels)), parts)):
        columns = {LABEL: pa.array(labels[rows], pa.float32())}
        columns.update({f.name: pa.array(dense[rows, i], pa.float32()) for i, f in enumerate(features.dense)})
        for f, (start, stop) in zip(features.sparse, features.slot_spans()):
            ids = np.ascontiguousarray(sparse[rows, start:stop], dtype=np.int32)
            if f.kind == "categorical":
                columns[f.name] = pa.array(ids[:, 0])
            else:
                columns[f.name] = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), f.max_length)
        pq.write_table(pa.table(columns), root / split / f"part-{k:05d}.parquet", row_group_size=row_group_size)


def write_mixed(root: Path, features: Features | None = None, train_rows: int = 2048, valid_rows: int = 512,
                seed: int = 0, parts: int = 2, row_group_size: int | None = None) -> Path:
    """Write `root/{train,valid}/part-*.parquet` and `root/schema.json` (with its label rate)."""
    features = features or mixed_features()
    rng = np.random.default_rng(seed)
    weights = [rng.normal(0.0, 1.0, size=f.cardinality) for f in features.sparse]
    for w in weights:
        w[0] = 0.0  # missing / padding carries no signal
    dense_weights = rng.normal(0.0, 1.5, size=features.num_dense)
    rates = {}
    for split, rows in (("train", train_rows), ("valid", valid_rows)):
        dense, sparse = draw_rows(features, rows, rng)
        logits = np.full(rows, -1.0)
        for w, (start, stop) in zip(weights, features.slot_spans()):
            logits += 1.2 * w[sparse[:, start:stop]].sum(axis=1)
        if features.num_dense:
            logits += (dense - dense.mean(0)) @ dense_weights
        labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        rates[split] = float(labels.mean())
        write_split(root, split, features, dense, sparse, labels, parts, row_group_size)
    Schema(cardinalities=features.cardinalities(), features=features, freq_threshold=1,
           rows={"train": train_rows, "valid": valid_rows}, vocab_hash=f"mixed-{seed}",
           label_rate=rates["train"]).save(root / "schema.json")
    return root
