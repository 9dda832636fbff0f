"""Throughput of ctrflow's Parquet loader alone: samples/s delivered on the GPU, no training.

    PYTHONPATH=src python3 benchmarks/loader_throughput.py [--rows 8000000] [--batch-size 65536]
    PYTHONPATH=src python benchmarks/loader_throughput.py --small      # seconds on a CPU

Writes a processed split (the preprocess layout: label, I1..I13 float32, C1..C26 int32) of
synthetic rows, reads it with `ParquetDataset`, then times whole shuffled epochs of `BatchLoader`
in two modes: `resident` (the split copied to the GPU once, batches gathered there) and `host`
(gathered on the host by the prefetch thread into pinned memory, copied with non_blocking). Each
batch is on the device and the device synchronized before the clock stops. Prints one JSON line.
Imports only numpy, pyarrow, torch and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ctrflow.data.loader import BatchLoader, ParquetDataset
from ctrflow.data.schema import DENSE, LABEL, SPARSE


def write_split(root: Path, rows: int, parts: int, cardinality: int, seed: int) -> None:
    """`root/train/part-*.parquet` with uniform ids below `cardinality` and log-normal dense values."""
    rng = np.random.default_rng(seed)
    (root / "train").mkdir(parents=True)
    for k, part in enumerate(np.array_split(np.arange(rows), parts)):
        n = len(part)
        columns = {LABEL: (rng.random(n) < 0.25).astype(np.float32)}
        columns.update({c: rng.lognormal(1.0, 1.0, n).astype(np.float32) for c in DENSE})
        columns.update({c: rng.integers(0, cardinality, n, dtype=np.int32) for c in SPARSE})
        pq.write_table(pa.table(columns), root / "train" / f"part-{k:05d}.parquet")


def time_epochs(loader: BatchLoader, device: torch.device, epochs: int, limit: int | None) -> dict:
    """Samples/s over `epochs` epochs (the first is a warm-up and not counted)."""
    rates = []
    for epoch in range(epochs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, samples, checksum = time.perf_counter(), 0, None
        for i, batch in enumerate(loader.batches(epoch)):
            if limit is not None and i >= limit:
                break
            batch = batch.to(device, non_blocking=True)
            checksum = batch.sparse[0, 0] if checksum is None else checksum + batch.sparse[0, 0]
            samples += len(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if epoch:
            rates.append(samples / (time.perf_counter() - start))
    return {"samples_per_s": float(np.median(rates)), "min": float(min(rates)), "max": float(max(rates)),
            "batches_per_epoch": min(len(loader), limit or len(loader))}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up epoch)")
    p.add_argument("--host-batches", type=int, default=40, help="batches per epoch in host mode (it is slow)")
    p.add_argument("--small", action="store_true", help="100k rows, batch 4096: seconds on a CPU")
    args = p.parse_args(argv)
    if args.small:
        args.rows, args.batch_size, args.parts, args.host_batches = 100_000, 4096, 2, 10
    return args


def main(argv=None) -> dict:
    """Write, read and time; print and return the result record."""
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"benchmark": "loader_throughput", "device": torch.cuda.get_device_name() if device.type == "cuda"
              else "cpu", "rows": args.rows, "batch": args.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        write_split(Path(tmp), args.rows, args.parts, 1_000_000, seed=0)
        t1 = time.perf_counter()
        dataset = ParquetDataset(tmp, "train", [1_000_000] * len(SPARSE))
        t2 = time.perf_counter()
    result.update(write_s=t1 - t0, read_s=t2 - t1, read_rows_per_s=args.rows / (t2 - t1),
                  resident_gib=dataset.resident_bytes() / 2**30)
    common = {"shuffle": True, "drop_last": True, "seed": 0}
    t3 = time.perf_counter()
    resident = BatchLoader(dataset, args.batch_size, device=device, **common)
    if device.type == "cuda":
        torch.cuda.synchronize()
    result["upload_s"] = time.perf_counter() - t3
    result["resident"] = time_epochs(resident, device, args.epochs, None)
    del resident
    host = BatchLoader(dataset, args.batch_size, pin_memory=device.type == "cuda", prefetch=4, **common)
    result["host"] = time_epochs(host, device, 1, args.host_batches)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
