"""Both passes of `--engine gpu` (`gpu_engine.GpuEngine`), with the CPU engine's accounting and outputs.

Blocks come back in input order with the same accounting dicts as the CPU engine's fit stage, so
bad rows stop the run or go to `rejected.tsv` exactly as there; the Parquet parts are numbered as
the CPU engine numbers them (`output.transform_tasks`) and written by a pool of threads.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ctrflow.contract.criteo import DENSE, SPARSE
from ctrflow.ingest.accounting import account_block, check_rows_written, collect_stats, file_stats
from ctrflow.ingest.blocks import bytes_per_block
from ctrflow.ingest.output import transform_tasks
from ctrflow.ingest.progress import progress_bar
from ctrflow.ingest.criteo.gpu_engine import GpuEngine, UnsupportedInput, vocabulary_tables, write_parts
from ctrflow.contract.vocab import write_vocab

__all__ = ["run_gpu", "UnsupportedInput"]


def run_gpu(files, tmp: Path, threshold: int, fraction: float, workers: int, on_bad_rows: str, seed: int,
            chunk_rows: int, progress: bool, compression: str, device: str) -> dict:
    """Fit, vocabulary and transform on `device`; returns stats as `ingest.run._run` does.
    Raises `UnsupportedInput` (before any part is written) where the CPU engine must run instead."""
    paths = {i: str(p) for i, (p, _) in enumerate(files)}
    engine = GpuEngine(device, paths, {i: s for i, (_, s) in enumerate(files)}, fraction, seed,
                       on_bad_rows == "error", workers)
    t0 = time.perf_counter()
    per_file, warnings = [file_stats(p, s) for p, s in files], []
    try:
        block_bytes = {i: bytes_per_block(Path(p), chunk_rows) for i, p in paths.items()}
        groups, records = fit_pass(engine, files, tmp, block_bytes, on_bad_rows, per_file, warnings,
                                   progress_bar(progress, "fit"))
    finally:
        engine.reader.close()
    check_rows_written(per_file)
    t1 = time.perf_counter()
    ordered = engine.order_vocabulary(threshold)
    t2 = time.perf_counter()
    with ThreadPoolExecutor(1) as side:  # the vocabulary files are made while the parts are written
        vocabulary = side.submit(_write_vocabulary, tmp, ordered)
        rows = transform_pass(engine, groups, records, str(tmp), compression, workers)
        tables, distinct = vocabulary.result()
    t3 = time.perf_counter()
    passes = {"fit_seconds": round(t1 - t0, 3), "vocab_seconds": round(t2 - t1, 3),
              "transform_seconds": round(t3 - t2, 3)}
    return collect_stats(records, per_file, distinct, tables, rows, warnings, passes, workers, chunk_rows,
                         DENSE, SPARSE)


def _write_vocabulary(tmp: Path, ordered) -> tuple[dict, dict]:
    tables, distinct = vocabulary_tables(ordered)
    write_vocab(tmp, tables)
    return tables, distinct


def fit_pass(engine: GpuEngine, files, tmp: Path, block_bytes: dict[int, int], on_bad_rows: str, per_file,
             warnings, bar):
    """Pass 1: (each group's rows, per-block records with `cache` = (group, block) where rows were kept)."""
    by_index = dict(enumerate(files))
    rejected = None if on_bad_rows == "error" else open(tmp / "rejected.tsv", "w", encoding="utf-8")
    groups, records = [], []
    try:
        if rejected:
            rejected.write("file\tline\treason\traw\n")
        with bar:
            for g, (rows, results) in enumerate(engine.fit(block_bytes)):
                groups.append(rows)
                for result in results:
                    account_block(result, by_index, per_file, rejected, warnings)
                    if result["cache"] is not None:
                        result["cache"] = (g, result["cache"])
                    records.append({k: result[k] for k in ("cache", "rows", "missing", "label_sum") if k in result})
                    bar.update(result["lines"])
    finally:
        if rejected:
            rejected.close()
    return groups, records


def transform_pass(engine: GpuEngine, groups, records, data_dir: str, compression: str, workers: int) -> dict:
    """Pass 2: ids on the device, parts written by threads (two groups in flight at most); rows per split."""
    tasks = defaultdict(list)
    for (g, k), parts in transform_tasks(records, {"train": 0, "valid": 0}):
        tasks[g].append((k, parts))
    pending = []
    with ThreadPoolExecutor(max(1, workers)) as writers:
        for g, rows in enumerate(groups):
            if not tasks[g]:
                continue
            ids, label, dense = engine.to_host(engine.ids(rows), rows.label, rows.dense)
            pending.append([writers.submit(write_parts, rows, ids, label, dense, k, parts, data_dir, compression)
                            for k, parts in tasks[g]])
            groups[g] = None  # free the device copy once its parts are written
            if len(pending) > 2:
                for job in pending.pop(0):
                    job.result()
        for jobs in pending:
            for job in jobs:
                job.result()
    return {split: sum(r["rows"][split] for r in records) for split in ("train", "valid")}
