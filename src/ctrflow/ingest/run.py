"""Raw rows of a dataset → Parquet + schema + vocabularies, streaming in two passes over every core.

The pipeline takes a dataset (`ctrflow.ingest.datasets.open_dataset`: the built-in Criteo TSV, or a
table in CSV, TSV or Parquet described by a file), which supplies the passes' worker stages; the rest
is the same for every dataset. Fit pass: blocks of whole rows are parsed on worker processes, their
training values counted and the parsed block cached; the counts merge into the vocabularies (the id
rule of docs/feature-contract.md). Transform pass: the cached blocks become Parquet parts in input
order. Everything is written under `DIR.tmp-<pid>` and renamed into place at the end, so a failed or
interrupted run leaves nothing that looks complete. The output is the same for any worker count and
chunk size.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

from ctrflow.errors import UserError
from ctrflow.ingest.accounting import (account_block, check_rows_written, collect_stats, file_stats, summarize,
                                           track)
from ctrflow.ingest.blockcache import CACHE, MEMORY_BYTES
from ctrflow.ingest.counting import RANGE_ENTRIES, SPILL_ENTRIES, remove_runs
from ctrflow.ingest.engines import check_engine
from ctrflow.contract.formats.files import expand_inputs, is_gzip
from ctrflow.ingest.growth import PreviousVocabulary, open_previous
from ctrflow.ingest.interop import write_hugectr_metadata, write_merlin_schema
from ctrflow.ingest.output import FileHasher, PieceChecksums, check_out_dir, publish, transform_tasks
from ctrflow.ingest.parallel import WorkerPool, reap
from ctrflow.ingest.progress import progress_bar
from ctrflow.processes import available_cores
from ctrflow.contract.vocab import write_vocab
from ctrflow.contract.schema import DENSE_TRANSFORM, Schema

# Parquet compression of the parts. "none" by default: 2.5x cheaper to write than snappy, and the
# parts are read once per epoch by the loader; "snappy" or "zstd" make files ~2.5x smaller.
COMPRESSIONS = ("none", "snappy", "zstd", "lz4")
DEFAULT_COMPRESSION = "none"


def preprocess(train: Sequence[str], valid: Sequence[str] = (), out: str | os.PathLike = "data",
               freq_threshold: int | None = None, valid_fraction: float | None = None, workers: int | None = None,
               on_bad_rows: str = "error", engine: str = "cpu", seed: int = 0, tracker=None,
               chunk_rows: int | None = None, progress: bool | None = None,
               compression: str = DEFAULT_COMPRESSION, spill_entries: int = SPILL_ENTRIES,
               range_entries: int = RANGE_ENTRIES, device: str = "cuda", dataset="criteo",
               vocab_from: str | os.PathLike | None = None, detach_removal: bool = False) -> dict:
    """Preprocess raw files into `out`; returns the summary (rows, cardinalities, vocab hash, seconds).
    `dataset`: "criteo" (the raw Criteo TSV), a dataset description file, a `Description` or an opened
    dataset. `freq_threshold`: the default threshold (else the description's, 6 for Criteo); per-column
    thresholds of the description apply beside it. `engine`: "cpu" (numpy, on `workers` processes) or
    "gpu" (Criteo only: parse, count and transform in this process on torch `device`: `gpu_engine`);
    the output is the same whichever runs. `vocab_from`: an earlier output of the same dataset whose
    vocabularies this one grows (`ctrflow.ingest.growth`: old values keep their ids, new ones follow;
    the CPU engine); schema.json then records it as its `parent`. `detach_removal`: an earlier output at
    `out` is deleted by a process this one does not wait for (`output.publish`; for a command about to exit).

    Memory: each worker holds one block (`chunk_rows`: 131,072 rows of Criteo by default, about 32 MB of
    text of a described table) and at most `spill_entries` (value, count) pairs; the final merge holds
    `range_entries` pairs per column at a time."""
    from ctrflow.ingest.datasets import open_dataset

    data = open_dataset(dataset, freq_threshold)
    _check_args(train, valid, valid_fraction, on_bad_rows, engine, chunk_rows)
    chunk_rows = data.chunk_rows(chunk_rows)
    if engine == "gpu" and "gpu" not in data.engines:
        raise UserError(f"--engine gpu reads only the raw Criteo TSV (--dataset criteo); use --engine cpu "
                        f"for {data.description.source}")
    if compression not in COMPRESSIONS:
        raise UserError(f"--compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    previous = None
    if vocab_from is not None:
        if engine == "gpu":
            raise UserError("--vocab-from runs on the CPU engine only: use --engine cpu (same output)")
        previous = open_grown(data, vocab_from)
    files = [(p, "split" if valid_fraction else "train") for p in expand_inputs(train)]
    files += [(p, "valid") for p in expand_inputs(valid)]
    data.check_inputs([p for p, _ in files])  # a column missing from a file: before any row is read
    out = Path(out)
    check_out_dir(out)
    workers = workers or available_cores()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    started = time.perf_counter()
    try:
        for sub in ("cache", "runs", "train", "valid"):
            (tmp / sub).mkdir(parents=True)
        checksums = PieceChecksums()  # plain files on the cpu engine: checksummed by the fit workers
        hashed = [p for p, _ in files if engine != "cpu" or is_gzip(p) or not data.checksums_pieces]
        with FileHasher(hashed) as hasher:
            stats = _run(data, files, tmp, valid_fraction or 0.0, workers, on_bad_rows, seed, chunk_rows,
                         _show_progress(progress), compression, spill_entries, range_entries, engine, device,
                         checksums, previous)
            file_digests = checksums.digests([p for p, _ in files], dict(zip(map(str, hashed), hasher.result())))
        stats["passes"]["total_seconds"] = round(time.perf_counter() - started, 3)
        schema = write_metadata(tmp, out, files, file_digests, stats, data, previous.parent() if previous else None)
        shutil.rmtree(tmp / "cache")
        shutil.rmtree(tmp / "runs")
        publish(tmp, out, detach_removal)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"{tmp}: no space left on device while writing the output") from None
        raise
    finally:
        CACHE.clear()  # blocks a failed run left in this process (one worker)
        shutil.rmtree(tmp, ignore_errors=True)
        reap()  # the workers exited while the output was published
    summary = summarize(out, schema, stats, workers)
    if tracker is not None:
        track(tracker, summary, stats, out, dict(
            dataset=data.description.source, train=list(map(str, train)), valid=list(map(str, valid)),
            freq_threshold=data.description.default_threshold, valid_fraction=valid_fraction, workers=workers,
            on_bad_rows=on_bad_rows, engine=engine, device=device, seed=seed, chunk_rows=chunk_rows,
            compression=compression, **({"vocab_from": str(previous.path)} if previous else {})))
    return summary


def open_grown(data, vocab_from: str | os.PathLike) -> PreviousVocabulary:
    """The earlier output whose vocabularies this run grows, checked against `data`'s features (an unset
    multi-hot max_length is the earlier output's)."""
    if (Path(vocab_from) / "schema.json").is_file():
        data.follow(Schema.load(vocab_from).features)
    return open_previous(vocab_from, data.description.features(dict.fromkeys(data.description.sparse, 0)))


def write_metadata(tmp: Path, out: Path, files, digests: list[str], stats: dict, data,
                   parent: dict | None = None) -> Schema:
    """Write schema.json, stats.json and the HugeCTR/NVTabular metadata into `tmp` (to be published at
    `out`). `data`: the dataset (its description and features go to schema.json); `parent`: the
    `--vocab-from` data the vocabularies grow (`PreviousVocabulary.parent`)."""
    cardinalities = stats.pop("cardinalities")
    label_sum = stats.pop("label_sum")
    train_rows = stats["rows"]["train"]
    features = data.description.features(cardinalities)
    same = all(f.transform == "log1p" for f in features.dense)  # the old key says one rule for every column
    schema = Schema(cardinalities=cardinalities, features=features,
                    dense_transform=DENSE_TRANSFORM if same else "per feature: features.dense[].transform",
                    freq_threshold=data.description.default_threshold, rows=dict(stats["rows"]),
                    vocab_hash=stats.pop("vocab_hash"), dataset=data.description.to_dict(),
                    label_rate=round(label_sum / train_rows, 9) if train_rows else None, parent=parent,
                    files=[{"path": str(Path(p).resolve()), "bytes": Path(p).stat().st_size, "digest": d,
                            "split": "train+valid" if s == "split" else s}
                           for (p, s), d in zip(files, digests)])
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    schema.save(tmp / "schema.json")
    for split in ("train", "valid"):
        write_hugectr_metadata(tmp / split, out / split, features)
    write_merlin_schema(tmp, features)  # not in train/: Parquet readers of a directory read every file
    return schema


def _check_args(train, valid, valid_fraction, on_bad_rows, engine, chunk_rows) -> None:
    if not train:
        raise UserError("no training input: give --train FILE...")
    if valid and valid_fraction:
        raise UserError("give either --valid files or --valid-fraction, not both")
    if valid_fraction is not None and not 0.0 <= valid_fraction < 1.0:
        raise UserError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    if on_bad_rows not in ("error", "skip"):
        raise UserError(f"--on-bad-rows must be 'error' or 'skip', got {on_bad_rows!r}")
    check_engine(engine)
    if chunk_rows is not None and chunk_rows < 1:
        raise UserError(f"--chunk-rows must be positive, got {chunk_rows}")


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    return sys.stderr.isatty() and not os.environ.get("CI")


def _run(data, files, tmp: Path, fraction: float, workers: int, on_bad_rows: str, seed: int,
         chunk_rows: int, progress: bool, compression: str, spill_entries: int = SPILL_ENTRIES,
         range_entries: int = RANGE_ENTRIES, engine: str = "cpu", device: str = "cuda",
         checksums: PieceChecksums | None = None, previous: PreviousVocabulary | None = None) -> dict:
    """Both passes; returns stats (with cardinalities, vocab hash and label sum for the schema).
    `checksums`: collects the input pieces' CRC-32 from the fit workers (the files' digests);
    `previous`: the vocabularies to grow (`--vocab-from`)."""
    if engine == "gpu":
        stats = data.run_gpu(files, tmp, fraction, workers, on_bad_rows, seed, chunk_rows, progress, compression,
                             device)
        if stats is not None:
            return stats
    _share_imports()
    fit = data.fit_stage([str(p) for p, _ in files], [s for _, s in files], str(tmp / "cache"), fraction, seed,
                         stop_at_bad_row=on_bad_rows == "error", run_dir=str(tmp / "runs"),
                         spill_entries=spill_entries, memory_bytes=MEMORY_BYTES // workers,
                         checksums=checksums is not None)
    with WorkerPool(workers) as pool:  # both passes on the same workers: blocks stay in their memory
        t0 = time.perf_counter()
        per_file, warnings = [file_stats(p, s) for p, s in files], []
        records, finals = fit_pass(data, fit, list(enumerate(files)), tmp, workers, chunk_rows, progress, per_file,
                                   warnings, pool, checksums)
        check_rows_written(per_file)
        data.settle(records, warnings)
        t1 = time.perf_counter()
        tables, distinct = build_vocabulary(data, finals, workers, range_entries, pool=pool,
                                            previous=str(previous.path) if previous else "")
        t2 = time.perf_counter()
        with ThreadPoolExecutor(1) as side:  # the vocabulary files are written while the parts are
            written = side.submit(write_vocab, tmp, tables)
            rows = transform_pass(data, records, tmp, compression, workers, progress, pool=pool, tables=tables)
            written.result()
        t3 = time.perf_counter()
    passes = {"fit_seconds": round(t1 - t0, 3), "vocab_seconds": round(t2 - t1, 3),
              "transform_seconds": round(t3 - t2, 3)}
    return collect_stats(records, per_file, distinct, tables, rows, warnings, passes, workers, chunk_rows,
                         data.description.dense, data.description.sparse, data.max_lengths, data.truncated)


def _share_imports() -> None:
    """Import before the workers fork what pyarrow imports on its first conversions, so that they share it
    (each would pay for its own otherwise): pandas (~0.3 CPU-s; where this process may import it:
    `without_pandas`), numpy.ma (for numpy arrays) and dateutil (for Python values): ~0.07 CPU-s."""
    try:
        import pandas  # noqa: F401
    except ImportError:  # pyarrow then runs without it
        pass
    import numpy as np
    import pyarrow as pa

    pa.array(np.zeros(1))
    pa.array([0.0])


def fit_pass(data, fit, files: list[tuple[int, tuple[Path, str]]], tmp: Path, workers: int, chunk_rows: int,
             progress: bool, per_file, warnings, pool: WorkerPool | None = None,
             checksums: PieceChecksums | None = None):
    """Pass 1 over every block of `files` ((file index, (path, split)) pairs), in order: (per-block records,
    each worker's counts). `per_file` (indexed by file index) gets each file's row accounting. `pool`:
    workers to run it on (and to keep for the transform pass), else a pool of `workers` for this pass.
    `checksums` gets the input pieces' CRC-32 the blocks report."""
    records, by_index = [], dict(files)
    rejected = None if fit.stop_at_bad_row else open(tmp / "rejected.tsv", "w", encoding="utf-8")
    try:
        if rejected:
            rejected.write("file\tline\treason\traw\n")
        with _own_pool(pool, workers) as pool, progress_bar(progress, "fit") as bar:
            tasks = data.tasks(files, chunk_rows, workers, str(tmp / "runs"))  # gzip tables decompress there
            for result in (r for results in pool.run(fit, tasks, finish=True) for r in results):
                account_block(result, by_index, per_file, rejected, warnings)
                if checksums is not None and result.get("pieces") is not None:
                    checksums.add(result["file"], *result["pieces"])
                records.append({k: result[k] for k in (*RECORD_KEYS, "worker") if k in result})  # no raw lines
                bar.update(result["lines"])
            finals = pool.finish()
    finally:
        if rejected:
            rejected.close()
    return records, finals


RECORD_KEYS = ("cache", "rows", "missing", "label_sum", "lists")  # what a block's record keeps


def build_vocabulary(data, finals: list[dict], workers: int, range_entries: int, remove: bool = True,
                     pool: WorkerPool | None = None, previous: str = ""):
    """Merge every worker's runs and held counts, column by column, on `pool`'s workers (else, or when
    every count is held in memory: on threads here, sparing the round trips to the workers):
    ({column: vocabulary table}, {column: distinct}); the run files are deleted afterwards unless
    `remove` is False. `previous`: the processed data whose vocabularies grow ("": none)."""
    names = data.description.sparse
    runs = [run for final in finals for run in final["runs"]]
    tasks = [(j, [f["other"][name] for f in finals if name in f["other"]]) for j, name in enumerate(names)]
    stage = data.merge_stage(runs, [data.description.threshold(name) for name in names], range_entries, previous)
    if pool is not None and runs:
        merged = list(pool.run(stage, tasks))
    else:
        stage.start()
        with ThreadPoolExecutor(workers) as threads:  # numpy's and pyarrow's sorts release the GIL
            merged = list(threads.map(stage.handle, tasks))
    if remove:
        remove_runs(runs)
    return ({name: table for name, (table, _) in zip(names, merged)},
            {name: n for name, (_, n) in zip(names, merged)})


def transform_pass(data, records: list[dict], tmp: Path, compression: str, workers: int, progress: bool,
                   first_parts: dict[str, int] | None = None, vocab_dir: str = "",
                   pool: WorkerPool | None = None, tables: dict | None = None) -> dict[str, int]:
    """Pass 2: cached blocks → Parquet parts, numbered in input order per split from `first_parts`
    (default 0); the vocabulary is `tables`, else read from `vocab_dir` (default `tmp`); rows per split.
    `pool`: the fit pass's workers (a block held in a worker's memory is transformed there), else a pool
    for this pass."""
    held = {r["cache"]: r.get("worker") for r in records}
    numbered = transform_tasks(records, first_parts or {"train": 0, "valid": 0})
    tasks = [(cache, parts, held[cache]) for cache, parts in numbered]
    rows = {split: sum(r["rows"][split] for r in records) for split in ("train", "valid")}
    stage = data.transform_stage(str(tmp), compression, vocab_dir, tables)
    with _own_pool(pool, min(workers, max(1, len(tasks)))) as pool, \
            progress_bar(progress, "transform", rows["train"] + rows["valid"]) as bar:
        for written in pool.run(stage, tasks, route=lambda task: task[2]):
            bar.update(sum(written.values()))
    return rows


def _own_pool(pool: WorkerPool | None, workers: int):
    """`pool` as is (its owner closes it), or a new pool of `workers` closed after the pass."""
    return nullcontext(pool) if pool is not None else WorkerPool(workers)
