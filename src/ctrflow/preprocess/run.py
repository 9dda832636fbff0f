"""Raw Criteo TSV → Parquet + schema + vocabularies, streaming in two passes over every core.

Fit pass: blocks of whole lines are parsed on worker processes, their training values counted and
the parsed block cached; the counts merge into the vocabularies (the id rule of
docs/feature-contract.md). Transform pass: the cached blocks become Parquet parts in input order. Everything is
written under `DIR.tmp-<pid>` and renamed into place at the end, so a failed or interrupted run
leaves nothing that looks complete. The output is the same for any worker count and chunk size.
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
from typing import Iterator, Sequence

from ctrflow.preprocess.accounting import account_block, collect_stats, file_stats, summarize, track
from ctrflow.preprocess.blockcache import CACHE, MEMORY_BYTES
from ctrflow.preprocess.counting import RANGE_ENTRIES, SPILL_ENTRIES, MergeStage, merge_vocabulary, remove_runs
from ctrflow.preprocess.files import Block, expand_inputs, is_gzip, plan_blocks
from ctrflow.preprocess.engines import check_engine
from ctrflow.preprocess.interop import write_hugectr_metadata, write_merlin_schema
from ctrflow.preprocess.output import FileHasher, PieceChecksums, check_out_dir, publish
from ctrflow.preprocess.parallel import WorkerPool, reap
from ctrflow.datasets.criteo.passes import FitStage, TransformStage, WholeFile
from ctrflow.schema import Schema
from ctrflow.datasets.criteo.columns import SPARSE
from ctrflow.preprocess.vocab import write_vocab
from ctrflow.errors import UserError
from ctrflow.datasets.criteo.columns import criteo_features

DEFAULT_CHUNK_ROWS = 1 << 17  # rows per block and Parquet part: sets memory per worker (~2 KB per row in flight)
# Parquet compression of the parts. "none" by default: 2.5x cheaper to write than snappy, and the
# parts are read once per epoch by the loader; "snappy" or "zstd" make files ~2.5x smaller.
COMPRESSIONS = ("none", "snappy", "zstd", "lz4")
DEFAULT_COMPRESSION = "none"
_SAMPLE_BYTES = 1 << 20


def preprocess(train: Sequence[str], valid: Sequence[str] = (), out: str | os.PathLike = "data",
               freq_threshold: int = 6, valid_fraction: float | None = None, workers: int | None = None,
               on_bad_rows: str = "error", engine: str = "cpu", seed: int = 0, tracker=None,
               chunk_rows: int = DEFAULT_CHUNK_ROWS, progress: bool | None = None,
               compression: str = DEFAULT_COMPRESSION, spill_entries: int = SPILL_ENTRIES,
               range_entries: int = RANGE_ENTRIES, device: str = "cuda") -> dict:
    """Preprocess raw files into `out`; returns the summary (rows, cardinalities, vocab hash, seconds).
    `engine`: "cpu" (numpy, on `workers` processes) or "gpu" (parse, count and transform in this
    process on torch `device`: `gpu_engine`); the output is the same whichever runs.

    Memory: each worker holds one block (`chunk_rows`) and at most `spill_entries` (value, count)
    pairs; the final merge holds `range_entries` pairs per column at a time."""
    _check_args(train, valid, freq_threshold, valid_fraction, on_bad_rows, engine, chunk_rows)
    if compression not in COMPRESSIONS:
        raise UserError(f"--compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    files = [(p, "split" if valid_fraction else "train") for p in expand_inputs(train)]
    files += [(p, "valid") for p in expand_inputs(valid)]
    out = Path(out)
    check_out_dir(out)
    workers = workers or available_cores()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    started = time.perf_counter()
    try:
        for sub in ("cache", "runs", "train", "valid"):
            (tmp / sub).mkdir(parents=True)
        checksums = PieceChecksums()  # plain files on the cpu engine: checksummed by the fit workers
        hashed = [p for p, _ in files if engine != "cpu" or is_gzip(p)]
        with FileHasher(hashed) as hasher:
            stats = _run(files, tmp, freq_threshold, valid_fraction or 0.0, workers, on_bad_rows, seed,
                         chunk_rows, _show_progress(progress), compression, spill_entries, range_entries,
                         engine, device, checksums)
            file_digests = checksums.digests([p for p, _ in files], dict(zip(map(str, hashed), hasher.result())))
        stats["passes"]["total_seconds"] = round(time.perf_counter() - started, 3)
        schema = write_metadata(tmp, out, files, file_digests, stats, freq_threshold)
        shutil.rmtree(tmp / "cache")
        shutil.rmtree(tmp / "runs")
        publish(tmp, out)
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
        track(tracker, summary, stats, out, dict(train=list(map(str, train)), valid=list(map(str, valid)),
               freq_threshold=freq_threshold, valid_fraction=valid_fraction, workers=workers,
               on_bad_rows=on_bad_rows, engine=engine, device=device, seed=seed, chunk_rows=chunk_rows,
               compression=compression))
    return summary


def write_metadata(tmp: Path, out: Path, files, digests: list[str], stats: dict, freq_threshold: int) -> Schema:
    """Write schema.json, stats.json and the HugeCTR/NVTabular metadata into `tmp` (to be published at `out`)."""
    cardinalities = stats.pop("cardinalities")
    schema = Schema(cardinalities=cardinalities, features=criteo_features(cardinalities), freq_threshold=freq_threshold,
                    rows=dict(stats["rows"]), vocab_hash=stats.pop("vocab_hash"),
                    files=[{"path": str(Path(p).resolve()), "bytes": Path(p).stat().st_size, "digest": d,
                            "split": "train+valid" if s == "split" else s}
                           for (p, s), d in zip(files, digests)])
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    schema.save(tmp / "schema.json")
    for split in ("train", "valid"):
        write_hugectr_metadata(tmp / split, out / split)
    write_merlin_schema(tmp, schema.cardinalities)  # not in train/: Parquet readers of a directory read every file
    return schema


def available_cores() -> int:
    """CPU cores this process may use (the default --workers)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _check_args(train, valid, freq_threshold, valid_fraction, on_bad_rows, engine, chunk_rows) -> None:
    if not train:
        raise UserError("no training input: give --train FILE...")
    if valid and valid_fraction:
        raise UserError("give either --valid files or --valid-fraction, not both")
    if valid_fraction is not None and not 0.0 <= valid_fraction < 1.0:
        raise UserError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    if freq_threshold < 1:
        raise UserError(f"--freq-threshold must be at least 1, got {freq_threshold}")
    if on_bad_rows not in ("error", "skip"):
        raise UserError(f"--on-bad-rows must be 'error' or 'skip', got {on_bad_rows!r}")
    check_engine(engine)
    if chunk_rows < 1:
        raise UserError(f"--chunk-rows must be positive, got {chunk_rows}")


def _show_progress(progress: bool | None) -> bool:
    if progress is not None:
        return progress
    return sys.stderr.isatty() and not os.environ.get("CI")


def _block_bytes(path: Path, chunk_rows: int) -> int:
    """Bytes per block for about `chunk_rows` rows, from the file's first megabyte."""
    first = next(plan_blocks(path, 0, _SAMPLE_BYTES), None) if is_gzip(path) else None
    if first is not None and first.data is not None:
        sample = first.data[:_SAMPLE_BYTES]
    else:
        with open(path, "rb") as f:
            sample = f.read(_SAMPLE_BYTES)
    per_row = len(sample) / max(1, sample.count(b"\n")) if sample else 256
    return max(1 << 12, int(chunk_rows * per_row))


def _tasks(files: list[tuple[int, tuple[Path, str]]], chunk_rows: int, workers: int) -> Iterator[Block | WholeFile]:
    """Fit tasks of (file index, (path, split)) in input order. Plain files: byte ranges each worker
    reads itself. Gzip files: whole files when there are enough of them to keep every worker busy
    (each worker decompresses its own), else blocks decompressed here. The blocks, and so the output,
    are the same either way."""
    gzipped = [is_gzip(path) for _, (path, _) in files]
    whole = workers > 1 and sum(gzipped) >= workers
    for (index, (path, _)), gz in zip(files, gzipped):
        if whole and gz:
            yield WholeFile(index, _block_bytes(path, chunk_rows))
        else:
            yield from plan_blocks(path, index, _block_bytes(path, chunk_rows))


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int) -> None:
        """Nothing to show."""


def _bar(enabled: bool, desc: str, total=None):
    """A tqdm bar with rows/s on a terminal; nothing otherwise (and no tqdm import)."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=" rows", unit_scale=True, leave=False)


def _run(files, tmp: Path, threshold: int, fraction: float, workers: int, on_bad_rows: str, seed: int,
         chunk_rows: int, progress: bool, compression: str, spill_entries: int = SPILL_ENTRIES,
         range_entries: int = RANGE_ENTRIES, engine: str = "cpu", device: str = "cuda",
         checksums: PieceChecksums | None = None) -> dict:
    """Both passes; returns stats (with cardinalities and vocab hash for the schema). `checksums`:
    collects the input pieces' CRC-32 from the fit workers (the files' digests)."""
    if engine == "gpu":
        from ctrflow.datasets.criteo.gpu_preprocess import UnsupportedInput, run_gpu

        try:
            return run_gpu(files, tmp, threshold, fraction, workers, on_bad_rows, seed, chunk_rows, progress,
                           compression, device)
        except UnsupportedInput:  # e.g. C values not 8 hex digits: the CPU engine's path, same output
            pass
    fit = FitStage([str(p) for p, _ in files], [s for _, s in files], str(tmp / "cache"), fraction, seed,
                   stop_at_bad_row=on_bad_rows == "error", run_dir=str(tmp / "runs"), spill_entries=spill_entries,
                   memory_bytes=MEMORY_BYTES // workers, checksums=checksums is not None)
    with WorkerPool(workers) as pool:  # both passes on the same workers: blocks stay in their memory
        t0 = time.perf_counter()
        per_file, warnings = [file_stats(p, s) for p, s in files], []
        records, finals = fit_pass(fit, list(enumerate(files)), tmp, workers, chunk_rows, progress, per_file,
                                   warnings, pool, checksums)
        t1 = time.perf_counter()
        tables, distinct = build_vocabulary(finals, threshold, workers, range_entries, pool=pool)
        t2 = time.perf_counter()
        with ThreadPoolExecutor(1) as side:  # the vocabulary files are written while the parts are
            written = side.submit(write_vocab, tmp, tables)
            rows = transform_pass(records, tmp, compression, workers, progress, pool=pool, tables=tables)
            written.result()
        t3 = time.perf_counter()
    passes = {"fit_seconds": round(t1 - t0, 3), "vocab_seconds": round(t2 - t1, 3),
              "transform_seconds": round(t3 - t2, 3)}
    return collect_stats(records, per_file, distinct, tables, rows, warnings, passes, workers, chunk_rows)


def fit_pass(fit: FitStage, files: list[tuple[int, tuple[Path, str]]], tmp: Path, workers: int, chunk_rows: int,
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
        with _own_pool(pool, workers) as pool, _bar(progress, "fit") as bar:
            for result in (r for results in pool.run(fit, _tasks(files, chunk_rows, workers)) for r in results):
                account_block(result, by_index, per_file, rejected, warnings)
                if checksums is not None and result.get("pieces") is not None:
                    checksums.add(result["file"], *result["pieces"])
                records.append({k: result[k] for k in ("cache", "rows", "missing", "worker")})  # no raw lines
                bar.update(result["lines"])
            finals = pool.finish()
    finally:
        if rejected:
            rejected.close()
    return records, finals


def build_vocabulary(finals: list[dict], threshold: int, workers: int, range_entries: int, remove: bool = True,
                     pool: WorkerPool | None = None):
    """Merge every worker's runs, column by column, on `pool`'s workers (else on threads here):
    ({column: vocabulary table}, {column: distinct}); the run files are deleted afterwards unless
    `remove` is False."""
    runs = [run for final in finals for run in final["runs"]]
    tasks = [(j, [f["other"][name] for f in finals]) for j, name in enumerate(SPARSE)]
    if pool is not None:
        merged = list(pool.run(MergeStage(runs, threshold, range_entries), tasks))
    else:
        with ThreadPoolExecutor(workers) as threads:  # numpy's and pyarrow's sorts release the GIL
            merged = list(threads.map(lambda task: merge_vocabulary(runs, task[1], task[0], threshold,
                                                                    range_entries), tasks))
    if remove:
        remove_runs(runs)
    return ({name: table for name, (table, _) in zip(SPARSE, merged)},
            {name: n for name, (_, n) in zip(SPARSE, merged)})


def transform_pass(records: list[dict], tmp: Path, compression: str, workers: int, progress: bool,
                   first_parts: dict[str, int] | None = None, vocab_dir: str = "",
                   pool: WorkerPool | None = None, tables: dict | None = None) -> dict[str, int]:
    """Pass 2: cached blocks → Parquet parts, numbered in input order per split from `first_parts`
    (default 0); the vocabulary is `tables`, else read from `vocab_dir` (default `tmp`); rows per split.
    `pool`: the fit pass's workers (a block held in a worker's memory is transformed there), else a pool
    for this pass."""
    held = {r["cache"]: r.get("worker") for r in records}
    numbered = _transform_tasks(records, first_parts or {"train": 0, "valid": 0})
    tasks = [(cache, parts, held[cache]) for cache, parts in numbered]
    rows = {split: sum(r["rows"][split] for r in records) for split in ("train", "valid")}
    stage = TransformStage(str(tmp), compression, vocab_dir, tables)
    with _own_pool(pool, min(workers, max(1, len(tasks)))) as pool, \
            _bar(progress, "transform", rows["train"] + rows["valid"]) as bar:
        for written in pool.run(stage, tasks, route=lambda task: task[2]):
            bar.update(sum(written.values()))
    return rows


def _own_pool(pool: WorkerPool | None, workers: int):
    """`pool` as is (its owner closes it), or a new pool of `workers` closed after the pass."""
    return nullcontext(pool) if pool is not None else WorkerPool(workers)


def _transform_tasks(records: list[dict], first_parts: dict[str, int]) -> Iterator[tuple[str, dict[str, int]]]:
    parts = dict(first_parts)
    for record in records:
        if record["cache"] is None:
            continue
        task = {}
        for split in ("train", "valid"):
            if record["rows"][split]:
                task[split] = parts[split]
                parts[split] += 1
        yield record["cache"], task
