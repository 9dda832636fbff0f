"""Throughput of ctrflow's Parquet loaders alone: samples/s delivered on the GPU, no training.

    PYTHONPATH=src python3 benchmarks/loader_throughput.py [--rows 8000000] [--batch-size 65536]
    PYTHONPATH=src python3 benchmarks/loader_throughput.py --rows 24000000 --threads 4,8,16 --cold
    PYTHONPATH=src python benchmarks/loader_throughput.py --small      # seconds on a CPU

Writes a processed split in the preprocess layout (parts of `--part-rows` rows, one row group each
unless `--row-group-rows`, no compression, no dictionary; label, I1..I13 float32, C1..C26 int32)
of synthetic rows, then times whole shuffled epochs in three modes:
`resident` (`ParquetDataset` read whole, copied to the GPU once, batches gathered there), `host`
(gathered on the host by the prefetch thread into pinned memory, copied with non_blocking) and
`stream` (`StreamLoader`: row groups decoded by threads into pinned windows, one copy per window,
gathered on the GPU; bounded memory), for each `--threads` value. Each batch is on the device and
the device synchronized before the clock stops. `--modes scan` times evaluation's in-order reader
(`ScanLoader`). `--cold` drops the parts from the page cache (`drop_caches` as root, else fsync +
posix_fadvise DONTNEED), records the fraction still cached (mincore) and times a plain threaded
read of the files (the disk's ceiling), one stream epoch and one scan from disk. Prints one JSON line.
Imports only numpy, pyarrow, torch and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ctrflow.loaders.memory import BatchLoader, ParquetDataset
from ctrflow.contract.schema import LABEL, Schema
from ctrflow.contract.criteo import DENSE, SPARSE
from ctrflow.loaders.scan import ScanLoader
from ctrflow.loaders.stream import DEFAULT_WINDOW, StreamLoader
from ctrflow.loaders.stream_plan import ParquetIndex
from ctrflow.contract.criteo import criteo_features

sys.path.insert(0, str(Path(__file__).parent))
from page_cache import cached_fraction, cold, disk_read  # noqa: E402

CARDINALITY = 1_000_000


def write_split(root: Path, rows: int, part_rows: int, group_rows: int | None, seed: int,
                compression: str = "none", data: str = "uniform") -> None:
    """`root/train/part-*.parquet`. `uniform`: ids uniform below CARDINALITY, log-normal dense values
    (hardly compressible). `zipf`: Zipf(1.15) ids capped at 10..10^6 per feature, dense log1p of
    integer counts, as preprocess writes Criteo (snappy 2.15x, zstd 3.4x smaller; a real
    10k-row Criteo sample: 2.1x, 3.2x)."""
    (root / "train").mkdir(parents=True)

    def write(k: int) -> None:
        rng = np.random.default_rng([seed, k])
        n = min(part_rows, rows - k * part_rows)
        columns = {LABEL: (rng.random(n, dtype=np.float32) < 0.25).astype(np.float32)}
        if data == "zipf":
            columns.update({c: np.log1p(np.floor(rng.lognormal(1.0, 2.0, n))).astype(np.float32) for c in DENSE})
            columns.update({c: (np.minimum(rng.zipf(1.15, n), 10 ** (1 + i % 6)) - 1).astype(np.int32)
                            for i, c in enumerate(SPARSE)})
        else:
            columns.update({c: rng.lognormal(1.0, 1.0, n).astype(np.float32) for c in DENSE})
            columns.update({c: rng.integers(0, CARDINALITY, n, dtype=np.int32) for c in SPARSE})
        pq.write_table(pa.table(columns), root / "train" / f"part-{k:05d}.parquet", compression=compression,
                       use_dictionary=False, row_group_size=group_rows or part_rows)

    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(write, range(-(-rows // part_rows))))


def write_schema(root: Path, args) -> None:
    """`root/schema.json`: Criteo's features with the table sizes `write_split` drew ids from."""
    sizes = [10 ** (1 + i % 6) if args.data == "zipf" else CARDINALITY for i in range(len(SPARSE))]
    cardinalities = dict(zip(SPARSE, sizes))
    Schema(cardinalities=cardinalities, features=criteo_features(cardinalities), freq_threshold=1,
           rows={"train": args.rows}, vocab_hash=f"loader-benchmark-{args.data}").save(root / "schema.json")


def time_epochs(loader, device: torch.device, epochs: int, limit: int | None) -> dict:
    """Samples/s over `epochs` epochs (the first is a warm-up and not counted), and the wait for
    each epoch's first batch (the stream's first window). The stream is bound by its decode threads,
    so its whole-epoch rate is their rate; no "steady" rate is taken after the first batch (the rest
    of the first window comes at once and would inflate it)."""
    rates, first = [], []
    for epoch in range(epochs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, samples, checksum, t_first = time.perf_counter(), 0, None, None
        for i, batch in enumerate(loader.batches(epoch)):
            if limit is not None and i >= limit:
                break
            batch = batch.to(device, non_blocking=True)
            checksum = batch.sparse[0, 0] if checksum is None else checksum + batch.sparse[0, 0]
            samples += len(batch)
            if t_first is None:
                t_first = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        if epoch:
            rates.append(samples / (end - start))
            first.append(t_first - start)
    return {"samples_per_s": float(np.median(rates)), "min": float(min(rates)), "max": float(max(rates)),
            "first_batch_s": float(np.median(first)),
            "batches_per_epoch": min(len(loader), limit or len(loader))}


def time_stream(root: Path, args, device: torch.device) -> dict:
    """Stream mode for each thread count (and one cold epoch with `--cold`)."""
    out = {}
    index = ParquetIndex(root, "train")
    size = sum(p.stat().st_size for p in (root / "train").iterdir())
    for threads in args.threads if "stream" in args.modes else ():
        loader = StreamLoader(index, args.batch_size, seed=0, window_rows=args.window, device=device,
                              threads=threads, table_sizes=[CARDINALITY] * len(SPARSE))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out[f"stream_t{threads}"] = time_epochs(loader, device, args.epochs, None)
        loader.close()  # the last epoch's lookahead
        out[f"stream_t{threads}"]["buffer_gib"] = loader.buffer_bytes() / 2**30
        if device.type == "cuda":
            out[f"stream_t{threads}"]["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.cold and "stream" in args.modes:
        cold(root, out, "disk")
        out["disk_read"] = disk_read(root, max(args.threads))
        cold(root, out, "stream")
        loader = StreamLoader(index, args.batch_size, seed=0, window_rows=args.window, device=device,
                              threads=max(args.threads), table_sizes=[CARDINALITY] * len(SPARSE), epochs=8)
        out["stream_cold"] = one_epoch(loader, device)
        out["stream_cold"]["gb_per_s"] = size / out["stream_cold"]["seconds"] / 1e9
        out["stream_cached_after_epoch"] = cached_fraction(root)
    if "scan" in args.modes:  # evaluation's in-order reader, warm then (with --cold) cold
        scan = ScanLoader(index, args.eval_batch_size, device=device, threads=max(args.threads),
                          table_sizes=[CARDINALITY] * len(SPARSE))
        one_epoch(scan, device)
        out["scan"] = one_epoch(scan, device)
        out["scan"]["buffer_gib"] = scan.buffer_bytes() / 2**30
        if args.cold:
            cold(root, out, "scan")
            out["scan_cold"] = one_epoch(scan, device)
            out["scan_cold"]["gb_per_s"] = size / out["scan_cold"]["seconds"] / 1e9
    return out


def one_epoch(loader, device: torch.device) -> dict:
    """Samples/s of one epoch with no warm-up (the cold read: a warm-up would fill the page cache)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, samples = time.perf_counter(), 0
    for batch in loader.batches(7):
        samples += len(batch.to(device, non_blocking=True))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"samples_per_s": samples / seconds, "batches": len(loader), "seconds": seconds}


def time_memory(root: Path, args, device: torch.device, result: dict) -> None:
    """Resident and host modes (the whole split read into host memory first)."""
    t0 = time.perf_counter()
    dataset = ParquetDataset(root, "train", [CARDINALITY] * len(SPARSE))
    result.update(read_s=time.perf_counter() - t0, resident_gib=dataset.resident_bytes() / 2**30)
    common = {"shuffle": True, "drop_last": True, "seed": 0}
    if "resident" in args.modes:
        t1 = time.perf_counter()
        resident = BatchLoader(dataset, args.batch_size, device=device, **common)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["upload_s"] = time.perf_counter() - t1
        result["resident"] = time_epochs(resident, device, args.epochs, None)
        del resident
    if "host" in args.modes:
        host = BatchLoader(dataset, args.batch_size, pin_memory=device.type == "cuda", prefetch=4, **common)
        result["host"] = time_epochs(host, device, 1, args.host_batches)


def print_table(result: dict) -> None:
    """A markdown table of the modes to stderr (the JSON line stays alone on stdout)."""
    lines = ["| mode | samples/s (median) | min | max | first batch s | buffers GiB | peak GPU GiB | file GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, r in result.items():
        if isinstance(r, dict) and ("samples_per_s" in r or "gb_per_s" in r):
            cells = [f"{r[k] / 1e6:.2f} M" if k in r else "" for k in ("samples_per_s", "min", "max")]
            cells += [f"{r[k]:.3f}" if k in r else "" for k in ("first_batch_s", "buffer_gib", "peak_gpu_gib",
                                                                  "gb_per_s")]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    print("\n".join(lines), file=sys.stderr, flush=True)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--part-rows", type=int, default=1 << 17, help="rows per part (preprocess: 131072)")
    p.add_argument("--row-group-rows", type=int, default=None, help="rows per row group (default: one per part)")
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up epoch)")
    p.add_argument("--host-batches", type=int, default=40, help="batches per epoch in host mode (it is slow)")
    p.add_argument("--modes", default="resident,host,stream")
    p.add_argument("--threads", default="16", help="stream: decode thread counts to time, comma-separated")
    p.add_argument("--eval-batch-size", type=int, default=262144, help="scan: rows per evaluation batch")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="stream: shuffle window rows")
    p.add_argument("--cold", action="store_true", help="stream: one more epoch with the parts out of the page cache")
    p.add_argument("--dir", default=None, help="where to write the split (default: a temporary directory)")
    p.add_argument("--compression", default="none", choices=("none", "snappy", "lz4", "zstd"))
    p.add_argument("--data", default="uniform", choices=("uniform", "zipf"), help="value distribution (write_split)")
    p.add_argument("--write-only", default=None, metavar="DIR",
                   help="write DIR/train and DIR/schema.json (for `ctrflow train`) and exit")
    p.add_argument("--small", action="store_true", help="100k rows, batch 4096: seconds on a CPU")
    args = p.parse_args(argv)
    if args.small:
        args.rows, args.batch_size, args.part_rows, args.host_batches = 100_000, 4096, 1 << 14, 10
        args.window, args.epochs = 1 << 15, 1
    args.modes = args.modes.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]
    return args


def main(argv=None) -> dict:
    """Write, read and time; print and return the result record."""
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"benchmark": "loader_throughput", "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "cpus": len(os.sched_getaffinity(0)), "rows": args.rows, "batch": args.batch_size,
              "part_rows": args.part_rows, "row_group_rows": args.row_group_rows or args.part_rows,
              "window": args.window, "compression": args.compression, "data": args.data}
    if args.write_only:
        write_split(Path(args.write_only), args.rows, args.part_rows, args.row_group_rows, 0, args.compression,
                    args.data)
        write_schema(Path(args.write_only), args)
        return result
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        write_split(Path(tmp), args.rows, args.part_rows, args.row_group_rows, 0, args.compression, args.data)
        write_schema(Path(tmp), args)  # the loaders read the features there
        result["write_s"] = time.perf_counter() - t0
        result["parquet_gib"] = sum(p.stat().st_size for p in Path(tmp, "train").iterdir()) / 2**30
        result["parquet_bytes"] = sum(p.stat().st_size for p in Path(tmp, "train").iterdir())
        if {"stream", "scan"} & set(args.modes):
            result.update(time_stream(Path(tmp), args, device))
        if {"resident", "host"} & set(args.modes):
            time_memory(Path(tmp), args, device, result)
    print(json.dumps(result), flush=True)
    print_table(result)
    return result


if __name__ == "__main__":
    main()
