"""Tables larger than the GPU: all tables on the GPU against the tables beyond a memory budget in host
memory with a GPU cache of hot rows (`ctrflow.embedding.placement`; the fused path's
`ctrflow.embedding.fused.cached`, or the plain path's `ctrflow.embedding.cache`).

    PYTHONPATH=src python3 benchmarks/host_tier.py                         # DLRMv2 shape, 32 GiB budget
    PYTHONPATH=src python3 benchmarks/host_tier.py --shape onehot-dim256   # 179 GiB of tables: cached only
    PYTHONPATH=src python3 benchmarks/host_tier.py --path plain            # the plain collection
    PYTHONPATH=src python3 benchmarks/host_tier.py --small                 # tiny, on the CPU: seconds
    PYTHONPATH=src python3 benchmarks/host_tier.py --profile DIR           # + each side's profile and timeline
    PYTHONPATH=src python3 benchmarks/host_tier.py --dense fp8             # the whole DLRMv2 training step

Shapes: `dlrmv2` is MLPerf DLRMv2's (26 tables of its sizes, capped at `--row-cap`, bags of its hotness,
214 ids a sample, sum pooling, dim 128); `onehot-dim256` is the one-hot MLPerf DLRM's (26 tables of
`sharded_parts.MLPERF_TABLES`, one id each, dim 256: more than one H200 holds, so only the cached side
runs). Ids are Zipf-skewed as `benchmarks/dlrmv2.py` draws them (log-uniform over each table's rows),
a fresh batch every step, drawn one step ahead. Row-wise Adagrad, fp32 tables. The fused path (default):
one `FusedEmbeddingCollection` (bf16 output, the optimizer in backward), the next batch prefetched
just before each step as `ctrflow train` does; the plain path: `EmbeddingCollection` with
`SparseOptimizer`, the next batch prefetched after the forward. One step is the tables' lookup and
update under a fixed linear readout and BCE loss (no dense layers). With `--dense bf16|fp8` (fused path)
it is the whole training step instead: the DLRMv2 shape's DCNv2 as `benchmarks/dlrmv2.py`'s fast path
trains it, the one-hot shape's DLRM as `benchmarks/sharded_scale.py` does (bottom 512-256, top
1024-1024-512-256), the head compiled, dense Adam, the step graphed as `ctrflow train` graphs it
(`GraphedStep`: with host tables each batch's lookup runs before the replay, and the next batch's rows
move beside the step; `--cuda-graphs off`: eager), with torch's CPU threads as `ctrflow train` sets
them beside host tables (`move_threads`; `OMP_NUM_THREADS` overrides). `device` keeps
every table on the GPU; `cached` keeps the tables within `--budget-gib` of GPU memory (weights and
Adagrad state; `place_in_budget`) and the others in host memory with caches filling the rest of
the budget. Each side is built alone (the other freed first); samples/s from the median step of
`--iters` steps after `--warmup` steps and, on the cached side, as many more as fill every cache and
bring the rows read in a step to their steady level (`warm_up`; the hit rate and the bytes moved are
counted after the warmup). The record also gives the bus's rates (`pcie_rates`). `--small` runs on the
CPU in seconds with a budget of 30 % of the tables' bytes. Prints one JSON line. Imports only torch, triton and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from ctrflow.accel.accelerate import accelerate
from ctrflow.accel.graphs import GraphedStep
from ctrflow.accel.plan import RunPlan
from ctrflow.contract.features import Features
from ctrflow.embedding.collection import EmbeddingCollection, deferred_tables
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.cache import write_rows
from ctrflow.embedding.fused.cached import move_threads
from ctrflow.embedding.optimizers import SparseOptimizer, state_bytes
from ctrflow.embedding.placement import HostTier, place_in_budget
from ctrflow.embedding.plan import plan_sharding
from ctrflow.embedding.tables import TableConfig
from ctrflow.loaders.batch import Batch
from ctrflow.models import build_model
from ctrflow.runtime import Runtime

sys.path.insert(0, str(Path(__file__).parent))
from embedding_bag import HOTNESS, MLPERF_ROWS, median_ms, release  # noqa: E402
from dlrmv2 import OPTIM, base_model, dlrmv2_features  # noqa: E402
from sharded_parts import MLPERF_TABLES  # noqa: E402
from train_paths import fp8_plan, make_optimizers, make_step  # noqa: E402

GIB = 2**30
ONEHOT_ARCH = {"bottom_mlp": (512, 256), "top_mlp": (1024, 1024, 512, 256)}  # MLPerf DLRM's


def shape_tables(args) -> list[TableConfig]:
    """The 26 tables of `--shape` (rows capped at `--row-cap`)."""
    cap = (lambda n: min(n, args.row_cap)) if args.row_cap else (lambda n: n)
    if args.shape == "onehot-dim256":
        return [TableConfig(f"t_{i}", cap(rows), args.dim, f"C{i + 1}") for i, rows in enumerate(MLPERF_TABLES)]
    return [TableConfig(f"t_{i}", cap(rows), args.dim, f"C{i + 1}", length=hot, pooling="sum")
            for i, (rows, hot) in enumerate(zip(MLPERF_ROWS, HOTNESS))]


def draw_ids(tables: list[TableConfig], batch: int, device: torch.device, seed: int) -> torch.Tensor:
    """[B, S] Zipf-skewed ids (`embedding_bag.draw_ids`' rule for any tables: log-uniform, ids >= 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    columns = []
    for t in tables:
        u = torch.rand(batch, t.length, generator=gen, device=device, dtype=torch.float64)
        ids = torch.exp(u * math.log(float(t.num_embeddings))).long()
        columns.append(ids.clamp(1, max(t.num_embeddings - 1, 1)))
    return torch.cat(columns, dim=1)


def adagrad_bytes(t: TableConfig) -> int:
    """A table's weights and row-wise Adagrad state."""
    return state_bytes(t, "adagrad")


def host_rows(tables: list[TableConfig], args, budget: int | None) -> dict[str, int]:
    """{table: cache rows} of the tables the placement keeps in host memory within `budget` (None: none)."""
    if budget is None:
        return {}
    plan = place_in_budget(plan_sharding(tables, 1), tables, HostTier(budget, args.batch), adagrad_bytes)
    return {name: s.cache_rows for name, s in plan.on_host()}


def build(tables, args, device: torch.device, host: dict[str, int]):
    """(collection, step updating its tables given ids and the next step's ids, its host tensors)."""
    readout = torch.randn(len(tables), args.dim, device=device) / args.dim
    labels = torch.rand(args.batch, device=device).round()

    def loss_of(out):
        return torch.nn.functional.binary_cross_entropy_with_logits((out.float() * readout).sum((1, 2)), labels)

    if args.path == "plain":
        with deferred_tables():
            coll = EmbeddingCollection(tables, seed=args.seed)
        for name, rows in host.items():
            coll.place_on_host(name, rows, device)
        coll.materialize(device)  # one table at a time in host memory
        opt = SparseOptimizer(coll, "adagrad", lr=args.lr)

        def step(ids, following):
            out = coll(ids)
            if coll.caches:  # the next batch's rows move while this step runs
                coll.prefetch(following)
            opt.zero_grad()
            loss_of(out).backward()
            opt.step()

        return coll, step, [t for c in coll.caches.values() for t in (c.store, *c.host_state.values())]
    bf16 = torch.bfloat16 if device.type == "cuda" else torch.float32
    coll = FusedEmbeddingCollection(tables, seed=args.seed, optimizer="rowwise_adagrad", lr=args.lr,
                                    output_dtype=bf16, device=device, check_ids=False, host=host)
    if args.dense != "none":
        train = dense_step(coll, args, device, labels)
    else:
        def train(ids):
            loss_of(coll(ids)).backward()

    def step(ids, following):
        if coll.host is not None:  # as `ctrflow train`: this batch queued, the next one placed beside the step
            if not coll.host.queued:
                coll.prefetch(ids)
            coll.prefetch(following)
        train(ids)

    return coll, step, [t for c in (coll.host.caches.values() if coll.host else []) for t in c.host]


def dense_step(coll: FusedEmbeddingCollection, args, device: torch.device, labels: torch.Tensor):
    """The whole training step over `coll` in `--dense`'s precision (module doc): ids -> forward, backward
    (the tables' update), dense Adam; on CUDA one graph, as `ctrflow train` runs it."""
    cuda = device.type == "cuda"
    if args.shape == "dlrmv2":  # the dense layers only (tiny tables): the tables are coll's
        model = base_model(args, dlrmv2_features([1] * len(MLPERF_ROWS), HOTNESS))
    else:
        model = build_model("dlrm", Features.categorical([2] * len(MLPERF_TABLES), 13), args.dim, seed=args.seed,
                            **({"bottom_mlp": (16,), "top_mlp": (16,)} if args.small else ONEHOT_ARCH))
    model.embeddings = coll
    plan = RunPlan(device=str(device), embedding="fused", autocast="bf16" if cuda else "fp32",
                   fp8=fp8_plan(args, {"fp8"} if args.dense == "fp8" else set()), align_linear=cuda,
                   compile="head" if cuda else "off")
    accelerate(model, plan, Runtime(0, 1, device.index or 0, device))
    model.to(device)
    graphed = cuda and args.cuda_graphs == "auto"
    optimizers = make_optimizers(model, [], OPTIM, naive=False, capturable=graphed, fused=cuda)
    step = make_step(model, optimizers, device, autocast=cuda)
    dense = torch.log1p(torch.rand(args.batch, 13, device=device) * 8)
    if not graphed:
        return lambda ids: step(dense, ids, labels)
    graph = GraphedStep(lambda _model, batch, *_: step(batch.dense, batch.sparse, batch.labels),
                        host=coll if coll.host is not None else None)
    opts = SimpleNamespace(dense=optimizers[0], sparse=None)
    return lambda ids: graph(model, Batch(dense, ids, labels), opts, device)


def warm_up(coll, one_step, steps: int, most: int, window: int = 100) -> int:
    """`steps` steps, then more until every host cache is full and the rows read in a step stop falling
    (a `window` of steps reads 1 % or less fewer than the one before; at most `most` steps in all): the
    steady state, where each row read in evicts one, written back when a training batch changed it, and
    the fused cache's counts have parted the hot rows from the rest. Returns the steps."""
    caches = list(coll.caches.values()) if isinstance(coll, EmbeddingCollection) else (
        list(coll.host.caches.values()) if coll.host is not None else [])
    done = 0
    while done < steps or (done < most and any(bool((c.id_of[:c.cache_rows] < 0).any()) for c in caches)):
        one_step()
        done += 1
    before = None
    while caches and done + window <= most:
        start = rows_read(coll)
        for _ in range(window):
            one_step()
        done += window
        read = rows_read(coll) - start
        if before is not None and read > 0.99 * before:
            break
        before = read
    return done


def rows_read(coll) -> int:
    """Rows the host caches have read in so far."""
    if isinstance(coll, EmbeddingCollection):
        return sum(c.rows_looked_up - c.rows_hit for c in coll.caches.values())
    return sum(int(c.stats[2]) for c in coll.host.caches.values())


def restart_hit_rate(coll) -> None:
    """Count the cache's hits from now on (the timed steps, not the warmup's cold cache)."""
    if isinstance(coll, EmbeddingCollection):
        for cache in coll.caches.values():
            cache.rows_looked_up = cache.rows_hit = 0
    elif coll.host is not None:
        for cache in coll.host.caches.values():
            cache.stats.zero_()


def time_side(tables, args, device: torch.device, budget: int | None) -> dict:
    """One side's samples/s, hit rate and memory, freed when this returns."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    host = host_rows(tables, args, budget)
    coll, step, host_tensors = build(tables, args, device, host)
    turn = {"k": 0, "ids": draw_ids(tables, args.batch, device, args.seed)}

    def one_step():
        turn["k"] += 1
        following = draw_ids(tables, args.batch, device, args.seed + turn["k"])
        step(turn["ids"], following)
        turn["ids"] = following

    warmup = warm_up(coll, one_step, args.warmup, args.max_warmup)
    restart_hit_rate(coll)
    ms = median_ms(one_step, device, 0, args.iters)
    moved = coll.host.bytes_moved() if isinstance(coll, FusedEmbeddingCollection) and coll.host else None
    bus = pcie_rates(coll, moved[0] // args.iters, device) if moved and device.type == "cuda" else {}
    if args.profile and device.type == "cuda":
        write_profile(one_step, f"{args.profile}/host_tier-{args.shape}-{'cached' if host else 'device'}.txt")
    result = {"samples_per_s": args.batch / ms * 1e3, "step_ms": ms, "warmup_steps": warmup,
              "host_tables": len(host), "cache_rows": sum(host.values()), "cache_hit_rate": coll.cache_hit_rate(),
              "host_gib": sum(t.nbytes for t in host_tensors) / GIB,
              "gb_per_step": {"read": moved[0] / args.iters / 1e9, "written": moved[1] / args.iters / 1e9}
              if moved else None,
              "pcie_gb_per_s": bus,
              "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None}
    del coll, step, host_tensors, turn
    release()
    return result


def pcie_rates(coll: FusedEmbeddingCollection, nbytes: int, device: torch.device, repeats: int = 5) -> dict:
    """GB/s between pinned host memory and the GPU: bulk copies of `nbytes` (the bus's rate), and as many
    distinct random rows of the largest host table (weights only; the cache's access pattern) moved as
    the cache moves them: gathered by the CPU into pinned memory and copied to the GPU; and back, copied
    and scattered by the CPU and (where the table is registered with CUDA) written by the GPU."""
    cache = max(coll.host.caches.values(), key=lambda c: c.host[0].numel())
    host = cache.host[0]
    rows = max(1, min(nbytes // (host[0].numel() * host.element_size()), host.shape[0]))
    picked = torch.randperm(host.shape[0])[:rows].sort().values  # in row order, as the cache moves them
    pinned = torch.empty((rows, *host.shape[1:]), dtype=host.dtype, pin_memory=True)
    onto = torch.empty(pinned.shape, dtype=host.dtype, device=device)

    def rows_to_host():
        pinned.copy_(onto, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        host.index_copy_(0, picked, pinned)

    moves = {"bulk_to_gpu": lambda: onto.copy_(pinned, non_blocking=True),
             "bulk_to_host": lambda: pinned.copy_(onto, non_blocking=True),
             "rows_to_gpu": lambda: onto.copy_(torch.index_select(host, 0, picked, out=pinned), non_blocking=True),
             "rows_to_host": rows_to_host}  # the rows read, unchanged
    if cache.mapped:
        slots, count, at = torch.arange(rows, device=device), torch.tensor([rows], device=device), picked.to(device)
        moves["rows_to_host_by_gpu"] = lambda: write_rows(onto, slots, host, at, count, rows)
    moves["rows_to_gpu"]()
    moved = rows * host[0].numel() * host.element_size()
    return {name: moved / median_ms(move, device, 1, repeats) / 1e6 for name, move in moves.items()}


def write_profile(one_step, path: str, steps: int = 3) -> None:
    """GPU and CPU time per operation of `steps` more steps: which kernels the cached step adds, and
    whether it waits on the GPU or on the Python that queues it; and their timeline, every thread and
    stream (a Chrome trace beside `path`, for Perfetto or chrome://tracing)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    prof.export_chrome_trace(path.removesuffix(".txt") + ".trace.json")
    with open(path, "w") as f:
        f.write(f"{steps} steps, by GPU time\n")
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60))
        f.write(f"\n{steps} steps, by CPU time\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["dlrmv2", "onehot-dim256"], default="dlrmv2")
    p.add_argument("--path", choices=["fused", "plain"], default="fused")
    p.add_argument("--batch", type=int, default=None, help="default: 55,296 (dlrmv2), 65,536 (onehot-dim256)")
    p.add_argument("--row-cap", type=int, default=0, help="cap every table's rows (0: MLPerf's sizes)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="GPU memory the cached side's tables may take (default 32; onehot-dim256: 100)")
    p.add_argument("--lr", type=float, default=0.004)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-warmup", type=int, default=4000,
                   help="warmup steps at most, on the cached side (`warm_up`)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="tiny tables on the CPU, a budget of 30%% of them")
    p.add_argument("--profile", default="",
                   help="folder: each side's GPU and CPU time per operation of 3 steps, and their timeline")
    p.add_argument("--dense", choices=["none", "bf16", "fp8"], default="none",
                   help="time the whole training step, its dense part in this precision (fused path)")
    p.add_argument("--cuda-graphs", choices=["auto", "off"], default="auto",
                   help="with --dense: off runs the step eagerly (as `ctrflow train --cuda-graphs off`)")
    args = p.parse_args(argv)
    if args.dense != "none" and args.path != "fused":
        p.error("--dense times the fused path")
    if min(args.warmup, args.max_warmup, args.iters - 1) < 0:
        p.error("--warmup and --max-warmup must not be negative, --iters at least 1")
    onehot = args.shape == "onehot-dim256"
    args.dim = 256 if onehot else 128
    args.batch = args.batch or (65536 if onehot else 55296)
    args.budget_gib = args.budget_gib if args.budget_gib is not None else (100.0 if onehot else 32.0)
    if args.small:
        args.batch, args.dim, args.row_cap, args.warmup, args.max_warmup, args.iters = 32, 16, 20000, 3, 50, 5
    return args


def main(argv: list[str] | None = None) -> dict:
    """Parse flags, time the sides, print and return the JSON record."""
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if device.type == "cuda" and args.path == "fused" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(move_threads())  # as `ctrflow train` sets them
    tables = shape_tables(args)
    total = sum(adagrad_bytes(t) for t in tables)
    budget = int(0.3 * total) if args.small else int(args.budget_gib * GIB)
    cached = time_side(tables, args, device, budget)
    # the one-hot dim-256 shape does not fit one GPU: its cached side only
    whole = time_side(tables, args, device, None) if args.shape == "dlrmv2" or args.small else None
    record = {"benchmark": "host_tier", "path": args.path, "shape": args.shape,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "batch": args.batch, "dim": args.dim, "tables": len(tables),
              "step": "tables" if args.dense == "none" else f"whole, dense in {args.dense}" +
              (", graphed" if device.type == "cuda" and args.cuda_graphs == "auto" else ""),
              "ids_per_sample": sum(t.length for t in tables),
              "table_gib": total / GIB, "budget_gib": budget / GIB, "optimizer": "adagrad (row-wise)",
              "cpu_threads": torch.get_num_threads(),
              "device_samples_per_s": whole["samples_per_s"] if whole else None,
              "cached_samples_per_s": cached["samples_per_s"],
              "ratio": cached["samples_per_s"] / whole["samples_per_s"] if whole else None,
              "step_ms": {"device": whole["step_ms"] if whole else None, "cached": cached["step_ms"]},
              "warmup_steps": cached["warmup_steps"],
              "cache_hit_rate": cached["cache_hit_rate"], "host_tables": cached["host_tables"],
              "cache_rows": cached["cache_rows"], "host_gib": cached["host_gib"],
              "gb_per_step": cached["gb_per_step"], "pcie_gb_per_s": cached["pcie_gb_per_s"],
              "gpu_peak_gib": {"device": whole["gpu_peak_gib"] if whole else None, "cached": cached["gpu_peak_gib"]}}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
