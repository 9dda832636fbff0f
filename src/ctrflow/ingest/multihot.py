"""`ctrflow multihot`: MLPerf DLRMv2's multi-hot expansion of a preprocessed one-hot dataset.

Each categorical feature given a multi-hot size h > 1 becomes a multi-hot feature (sum pooling,
`max_length` h): a row's id stays the first id of its bag and h - 1 ids follow, drawn uniformly over
the feature's vocabulary ids (2 .. cardinality - 1) as a fixed function of (seed, feature, id)
(`ctrflow.contract.multihot.expand`, MLPerf's rule), so equal ids expand to equal bags and every
split and process agrees. A missing id (0) stays 0 in its bag: padding, nothing looked up. The other
columns, the vocabularies and the row order are copied as they are; `schema.json` records the sizes
and the seed under `dataset.multihot`.

Cost: one read and one write of every part, no sort, no vocabulary pass; the output's id columns grow
from 4 bytes a feature to 4 h bytes (MLPerf's sizes: 26 -> 214 ids a row, 104 -> 856 bytes; Criteo 1TB's
4.4 B rows then hold ~3.8 TB of ids uncompressed). One process, one part at a time: memory is two
parts' columns. Measured: 4.6 CPU-s for 400,000 Criteo rows (~87,000 rows a CPU-second; 31 -> 178 MB of
Parquet a split), so Criteo 1TB's 4.4 B rows would take ~14 CPU-hours.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from ctrflow.contract.features import FIRST_ID, LABEL, Feature, Features
from ctrflow.contract.multihot import HOTNESS, expand, feature_key
from ctrflow.contract.schema import Schema
from ctrflow.errors import UserError
from ctrflow.ingest.interop import write_hugectr_metadata, write_merlin_schema
from ctrflow.ingest.output import check_out_dir, part_schema, publish, write_part


def parse_sizes(text: str, count: int) -> tuple[int, ...]:
    """`--sizes`: "mlperf" (MLPerf DLRMv2's 26) or a comma list, one size >= 1 per sparse feature."""
    try:
        sizes = HOTNESS if text == "mlperf" else tuple(int(s) for s in text.split(","))
    except ValueError:
        raise UserError(f"--sizes must be mlperf or a comma list of integers, got {text!r}") from None
    if len(sizes) != count or min(sizes) < 1:
        raise UserError(f"--sizes: need {count} sizes >= 1 (one per sparse feature), got {len(sizes)}: {text}")
    return sizes


def expanded_features(features: Features, sizes: tuple[int, ...]) -> Features:
    """The features after the expansion: categorical ones of size > 1 become sum bags of that length."""
    sparse = []
    for f, h in zip(features.sparse, sizes):
        if h > 1 and f.kind != "categorical":
            raise UserError(f"feature {f.name}: already {f.kind}; only categorical features expand")
        sparse.append(f if h == 1 else Feature(f.name, "multi_hot", f.cardinality, max_length=h, pooling="sum"))
    return replace(features, sparse=tuple(sparse))


def expand_dataset(data: str, out: str, sizes: str = "mlperf", seed: int = 0) -> dict:
    """Write the expansion of the processed dataset `data` to `out` (module doc); returns a report."""
    started = time.perf_counter()
    source, target = Path(data), Path(out)
    schema = Schema.load(source)
    hotness = parse_sizes(sizes, len(schema.features.sparse))
    features = expanded_features(schema.features, hotness)
    check_out_dir(target)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    rows = 0
    try:
        for split in schema.rows:
            (tmp / split).mkdir(parents=True)
            for part in sorted((source / split).glob("part-*.parquet")):
                rows += expand_part(part, tmp / split / part.name, schema.features, features, hotness, seed)
            write_hugectr_metadata(tmp / split, target / split, features)
        shutil.copytree(source / "vocab", tmp / "vocab")
        for extra in ("stats.json",):
            if (source / extra).exists():
                shutil.copy2(source / extra, tmp / extra)
        write_merlin_schema(tmp, features)
        record = {**schema.dataset, "multihot": {"sizes": list(hotness), "seed": seed, "from": str(source)}}
        replace(schema, features=features, columns={}, dataset=record).save(tmp / "schema.json")
        publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - started
    return {"out": str(target), "rows": rows, "ids_per_row": features.slots, "seconds": round(seconds, 3)}


def expand_part(src: Path, dst: Path, before: Features, after: Features, hotness: tuple[int, ...],
                seed: int) -> int:
    """Expand one Parquet part; returns its rows."""
    table = pq.read_table(src)
    columns = {LABEL: table[LABEL].to_numpy()}
    columns.update({f.name: table[f.name].to_numpy() for f in before.dense})
    for index, (f, h) in enumerate(zip(before.sparse, hotness)):
        ids = table[f.name].to_numpy()
        if h > 1:
            low = min(FIRST_ID, f.cardinality - 1)
            ids = expand(ids.astype(np.int64), h, low, f.cardinality, feature_key(seed, index)).astype(np.int32)
        columns[f.name] = ids
    return write_part(columns, str(dst), "none", part_schema(after))
