"""What `sharded_scale.py` feeds and measures: the MLPerf Criteo-1TB table sizes, table init drawn
on the device shard by shard, synthetic batches (Zipf or uniform ids), the timing loop, the
profiler tables and per-process memory. Imports only torch and ctrflow."""

from __future__ import annotations

import argparse
import gzip
import math
import os
import resource
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ctrflow.loaders.batch import Batch
from ctrflow.embedding.plan import Shard
from ctrflow.embedding.tables import TableConfig

MLPERF_TABLES = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]

RunStep = Callable[[int], torch.Tensor]  # step i of the run (batch i mod the batches' count) -> loss


def device_init(seed: int):
    """Per-shard uniform(-1/sqrt(n), 1/sqrt(n)) drawn on the target device (fast; not the plain init)."""
    def init(table: TableConfig, index: int, shard: Shard, device: torch.device) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed * 1000003 + index * 1009 + shard.rank)
        bound = 1.0 / math.sqrt(table.num_embeddings)
        weight = torch.empty(shard.num_rows, shard.num_cols, device=device)
        return weight.uniform_(-bound, bound, generator=gen)

    return init


def synthetic_batches(tables: list[TableConfig], batch: int, count: int, device, seed: int,
                      ids: str = "uniform") -> list[Batch]:
    """`count` batches (dense [B,13], ids [B,26], labels [B]) drawn on `device`; ids uniform, or
    Zipf (rank k of a table of n rows has probability ~ 1/(k+1), ranks hashed over the table, the
    distribution of `train_throughput.py`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = torch.tensor([t.num_embeddings for t in tables], device=device, dtype=torch.int64)
    salt = torch.arange(len(tables), device=device) * 7919
    out = []
    for _ in range(count):
        if ids == "zipf":
            u = torch.rand(batch, len(tables), generator=gen, device=device, dtype=torch.float64)
            rank = torch.minimum(torch.exp(u * torch.log1p(n.double())).long() - 1, n - 1)
            ids_batch = (rank * 2654435761 + salt) % n
        else:
            ids_batch = torch.stack([torch.randint(0, t.num_embeddings, (batch,), generator=gen, device=device)
                                     for t in tables], dim=1)
        dense = torch.log1p(torch.rand(batch, 13, generator=gen, device=device) * 100)
        labels = torch.randint(0, 2, (batch,), generator=gen, device=device).float()
        out.append(Batch(dense, ids_batch, labels))
    return out


def time_steps(run: RunStep, warmup: int, steps: int, cuda: bool, first: int = 0) -> float:
    """Seconds per step over `steps` steps after `warmup` ones, from step `first` on."""
    for i in range(first, first + warmup + steps):
        if i == first + warmup:
            if cuda:
                torch.cuda.synchronize()  # timing starts with an idle device
            start = time.perf_counter()
        run(i)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / max(steps, 1)


def profile_ops(args: argparse.Namespace, runtime, run: RunStep) -> None:
    """Rank 0 writes the ATen ops of one eager step (after two), by input shape with their GPU time:
    what the kernels of a graph replay's profile came from (every rank steps)."""
    run(0), run(1)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        run(2)
        torch.cuda.synchronize()
    if runtime.is_main:
        with open(f"{args.profile}/ops-{args.embedding}-n{runtime.world_size}.txt", "w") as f:
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=70))


def profile_kernels(args: argparse.Namespace, runtime, run: RunStep, name: str = "") -> None:
    """Three more steps under the profiler; rank 0 writes the per-kernel table (`name`: every rank
    its own, `{name}-rank{r}.txt`), every rank its timeline (`trace-rank{r}.json.gz`: which kernels
    wait for which, the slowest rank)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        time_steps(run, 0, 3, True, first=args.warmup + args.steps)
    trace = f"{args.profile}/trace-rank{runtime.rank}.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as raw, gzip.open(trace + ".gz", "wb") as packed:
        packed.write(raw.read())
    os.remove(trace)
    if runtime.is_main or name:
        path = f"{name}-rank{runtime.rank}" if name else f"sharded-{args.embedding}-n{runtime.world_size}"
        with open(f"{args.profile}/{path}.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70))


def memory_gib(runtime) -> float:
    """Peak memory of this process: CUDA allocations on a GPU, resident set size on the CPU."""
    if runtime.device.type == "cuda":
        return torch.cuda.max_memory_allocated(runtime.device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gather(value, runtime) -> list:
    """`value` from every process, in rank order."""
    if not runtime.distributed:
        return [value]
    out = [None] * runtime.world_size
    dist.all_gather_object(out, value)
    return out
