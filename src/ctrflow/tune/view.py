"""Another frequency threshold without the raw data: a processed-data view per threshold.

Preprocessing keeps, per sparse feature, every value seen at least `freq_threshold` (T) times in the
training split, with its training count, in `vocab/<feature>.parquet`; row k has id k + 2 and rows are
by descending count (ties by value). A higher threshold T' therefore keeps a *prefix* of each
vocabulary: the rows whose count is >= T'. Every id past that prefix becomes OOV (1), ids 0 and 1
stay, and each table shrinks to the prefix + 2 rows. No id moves, so re-mapping is one comparison per
id: `id if id < prefix + 2 else 1`.

The view is a processed-data folder of its own, so train, evaluate and export read it unchanged:
`schema.json` with the new cardinalities, threshold and vocabulary hash; `vocab/` with the prefixes;
every split's `part-*.parquet` re-mapped row group by row group (same columns, same row groups, same
codec); `stats.json` copied; `view.json` naming the source and its vocabulary hash. It is written once
per distinct threshold into a temporary folder and renamed into place (`threshold_view`), so trials
and parallel workers share it and a crash leaves no half view. A view of a source that was
preprocessed again since (another vocabulary hash) is rebuilt.

T' < T is impossible (the counts of rarer values were not kept): refused with a one-line error. A
feature given its own threshold in the dataset description keeps its vocabulary; T' replaces the
default threshold, which the other features use.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ctrflow.errors import UserError
from ctrflow.contract.features import FIRST_ID, OOV_ID
from ctrflow.contract.schema import Schema

VIEW_FILE = "view.json"


def check_threshold(data: str | Path, threshold: int, where: str = "freq_threshold") -> None:
    """UserError unless `data` can be viewed at `threshold` (>= the preprocessing threshold)."""
    schema = Schema.load(data)
    if threshold < schema.freq_threshold:
        raise UserError(f"{where}: {threshold} is below the threshold {data} was preprocessed with "
                        f"({schema.freq_threshold}): the counts of rarer values were not kept; preprocess "
                        f"with a lower --freq-threshold")


def own_thresholds(schema: Schema) -> dict[str, int]:
    """Features the dataset description gives a threshold of their own (`freq_threshold: {default: 6,
    userId: 2}`): their vocabularies do not follow the default threshold."""
    raw = (schema.dataset or {}).get("freq_threshold")
    return {k: int(v) for k, v in raw.items() if k != "default"} if isinstance(raw, dict) else {}


def kept_rows(data: Path, schema: Schema, threshold: int) -> dict[str, int]:
    """`{feature: vocabulary rows kept at threshold}` for the features that follow the default
    threshold; checks that each vocabulary is ordered by descending count."""
    kept = {}
    own = own_thresholds(schema)
    for feature in schema.features.sparse:
        if feature.name in own:
            continue
        path = data / "vocab" / f"{feature.name}.parquet"
        if not path.exists():
            raise UserError(f"{path}: missing: another freq_threshold needs the vocabularies preprocess writes")
        counts = pq.read_table(path, columns=["count"]).column("count").to_numpy()
        if len(counts) != feature.cardinality - FIRST_ID:
            raise UserError(f"{path}: {len(counts)} values, but schema.json says {feature.cardinality - FIRST_ID}")
        if np.any(np.diff(counts) > 0):
            raise UserError(f"{path}: counts are not in descending order: not a ctrflow vocabulary")
        kept[feature.name] = int(np.count_nonzero(counts >= threshold))
    return kept


def threshold_view(data: str | Path, threshold: int, views: str | Path) -> Path:
    """The processed data of `data` at frequency threshold `threshold`: `data` itself at its own
    threshold, else `views/threshold_<T>` (written now unless a current one is there)."""
    data = Path(data).resolve()
    check_threshold(data, threshold)
    schema = Schema.load(data)
    if threshold == schema.freq_threshold:
        return data
    target = Path(views) / f"threshold_{threshold}"
    if _current(target, data, schema):
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_view(data, schema, threshold, tmp)
        if target.exists():  # stale (the source changed), or another worker's, just written
            if _current(target, data, schema):
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _current(view: Path, data: Path, schema: Schema) -> bool:
    """Whether `view` is a finished view of `data` as it is now."""
    try:
        record = json.loads((view / VIEW_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return record.get("source") == str(data) and record.get("source_vocab_hash") == schema.vocab_hash


def write_view(data: Path, schema: Schema, threshold: int, out: Path) -> Schema:
    """Write the view of `data` at `threshold` into `out` (module doc); returns its schema."""
    kept = kept_rows(data, schema, threshold)
    out.mkdir(parents=True)
    (out / "vocab").mkdir()
    values = {}
    for feature in schema.features.sparse:
        table = pq.read_table(data / "vocab" / f"{feature.name}.parquet")
        if feature.name in kept:
            table = table.slice(0, kept[feature.name])
        pq.write_table(table, out / "vocab" / f"{feature.name}.parquet")
        values[feature.name] = table.column("value")
    limits = {name: FIRST_ID + n for name, n in kept.items()}  # first id that becomes OOV
    for split in sorted(p.parent.name for p in data.glob("*/part-*.parquet")):
        if (out / split).exists():
            continue
        (out / split).mkdir()
        for part in sorted((data / split).glob("part-*.parquet")):
            remap_part(part, out / split / part.name, limits)
    if (data / "stats.json").exists():
        shutil.copy2(data / "stats.json", out / "stats.json")
    view = _view_schema(schema, threshold, kept, values)
    view.save(out / "schema.json")
    (out / VIEW_FILE).write_text(json.dumps({"source": str(data), "source_vocab_hash": schema.vocab_hash,
                                             "freq_threshold": threshold, "source_freq_threshold":
                                             schema.freq_threshold, "kept": kept}, indent=2) + "\n")
    return view


def _view_schema(schema: Schema, threshold: int, kept: dict[str, int], values: dict[str, pa.ChunkedArray]) -> Schema:
    from ctrflow.contract.vocab import vocab_hash

    sparse = tuple(replace(f, cardinality=FIRST_ID + kept[f.name]) if f.name in kept else f
                   for f in schema.features.sparse)
    features = replace(schema.features, sparse=sparse)
    dataset = dict(schema.dataset or {})
    if isinstance(dataset.get("freq_threshold"), dict):
        dataset["freq_threshold"] = {**dataset["freq_threshold"], "default": threshold}
    elif "freq_threshold" in dataset:
        dataset["freq_threshold"] = threshold
    return replace(schema, features=features, cardinalities=features.cardinalities(), freq_threshold=threshold,
                   vocab_hash=vocab_hash({f.name: values[f.name] for f in sparse}), dataset=dataset)


def remap_part(source: Path, target: Path, limits: dict[str, int]) -> int:
    """Copy Parquet part `source` to `target` with every id >= `limits[column]` of the named columns
    (int32, or fixed-size lists of int32 for multi-hot) set to OOV; row groups and codec kept.
    Returns the rows written."""
    reader = pq.ParquetFile(source)
    codec = reader.metadata.row_group(0).column(0).compression if reader.metadata.num_row_groups else "NONE"
    codec = "none" if codec == "UNCOMPRESSED" else codec.lower()
    rows = 0
    with pq.ParquetWriter(target, reader.schema_arrow, compression=codec, use_dictionary=False,
                          write_statistics=False) as writer:
        for index in range(reader.metadata.num_row_groups):
            group = reader.read_row_group(index)
            columns = [remap_ids(group.column(name), limits[name]) if name in limits else group.column(name)
                       for name in group.column_names]
            writer.write_table(pa.Table.from_arrays(columns, schema=group.schema))
            rows += len(group)
    return rows


def remap_ids(column: pa.ChunkedArray, limit: int) -> pa.ChunkedArray:
    """`column` (int32 ids, or fixed-size lists of them) with ids >= `limit` set to OOV."""
    chunks = []
    for chunk in column.chunks:
        if pa.types.is_fixed_size_list(chunk.type):
            flat = chunk.flatten().to_numpy(zero_copy_only=False)  # no nulls in processed data
            flat = np.where(flat >= limit, np.int32(OOV_ID), flat).astype(np.int32)
            chunks.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, chunk.type.value_type), type=chunk.type))
        else:
            ids = chunk.to_numpy(zero_copy_only=False)
            chunks.append(pa.array(np.where(ids >= limit, np.int32(OOV_ID), ids).astype(np.int32), chunk.type))
    return pa.chunked_array(chunks, column.type)


__all__ = ["VIEW_FILE", "check_threshold", "kept_rows", "own_thresholds", "remap_ids", "remap_part",
           "threshold_view", "write_view"]
