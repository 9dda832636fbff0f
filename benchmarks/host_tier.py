"""Tables larger than the GPU: all tables on the GPU against the tables beyond a memory budget in host
memory with a GPU cache of hot rows (`ctrflow.embedding.placement`, `ctrflow.embedding.cache`).

    PYTHONPATH=src python3 benchmarks/host_tier.py                      # MLPerf DLRMv2 shape, 32 GiB budget
    PYTHONPATH=src python3 benchmarks/host_tier.py --row-cap 4000000 --budget-gib 4
    PYTHONPATH=src python3 benchmarks/host_tier.py --small              # tiny, on the CPU: seconds

The shape of MLPerf DLRMv2 (`embedding_bag.py`: 26 tables of its sizes, capped at `--row-cap`, bags of
its hotness, 214 ids a sample, sum pooling, dim 128, fp32), ids Zipf-skewed (log-uniform over each
table's rows: a few rows take most lookups). Both sides run the same code, one training step of the
plain collection (`EmbeddingCollection`) under a fixed linear readout and BCE loss, row-wise Adagrad
on the tables (`SparseOptimizer`): `device` keeps every table on the GPU; `cached` places the tables
within `--budget-gib` of GPU memory (weights and Adagrad state; `place_in_budget`), the others in
host memory (pinned) with GPU caches filling the rest of the budget, the next batch's rows prefetched
while the current step runs. A batch of ids is drawn per step from `--batches` distinct batches in
turn. Each side is built alone (the other freed first); samples/s from the median step time of
`--iters` steps after `--warmup`. `--small` runs both on the CPU in seconds with a budget of 30 % of
the tables' bytes. Prints one JSON line: both sides' samples/s and their ratio, the cache's hit rate
(distinct rows per batch found cached), host memory of the host tables, peak GPU memory, GPU, batch.
Imports only torch and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ctrflow.embedding.collection import EmbeddingCollection, deferred_tables
from ctrflow.embedding.optimizers import SparseOptimizer, state_bytes
from ctrflow.embedding.placement import HostTier, place_in_budget
from ctrflow.embedding.plan import plan_sharding
from ctrflow.embedding.tables import TableConfig

sys.path.insert(0, str(Path(__file__).parent))
from embedding_bag import HOTNESS, MLPERF_ROWS, draw_ids, median_ms, release  # noqa: E402

GIB = 2**30


def dlrmv2_tables(args) -> list[TableConfig]:
    """MLPerf DLRMv2's 26 tables (rows capped at `--row-cap`), multi-hot bags of its hotness, sum pooling."""
    return [TableConfig(f"t_{i}", min(rows, args.row_cap) if args.row_cap else rows, args.dim, f"C{i + 1}",
                        length=hot, pooling="sum") for i, (rows, hot) in enumerate(zip(MLPERF_ROWS, HOTNESS))]


def adagrad_bytes(t: TableConfig) -> int:
    """A table's weights and row-wise Adagrad state."""
    return state_bytes(t, "adagrad")


def build(tables: list[TableConfig], args, device: torch.device, budget: int | None):
    """(collection, host tables, cache rows): every table on `device`, or with `budget` those the
    placement puts in host memory there with their caches."""
    plan = plan_sharding(tables, 1)
    if budget is not None:
        plan = place_in_budget(plan, tables, HostTier(budget, args.batch), adagrad_bytes)
    with deferred_tables():
        coll = EmbeddingCollection(tables, seed=args.seed)
    host = dict(plan.on_host())
    for name, shard in host.items():
        coll.place_on_host(name, shard.cache_rows, device)
    coll.materialize(device)  # one table at a time in host memory (MLPerf's are 20 GB each)
    return coll, len(host), sum(s.cache_rows for s in host.values())


def time_side(tables, batches: list[torch.Tensor], args, device: torch.device, budget: int | None) -> dict:
    """One side's samples/s, hit rate and memory, freed when this returns."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    coll, host_tables, cache_rows = build(tables, args, device, budget)
    opt = SparseOptimizer(coll, "adagrad", lr=args.lr)
    readout = torch.randn(len(tables), args.dim, device=device) / args.dim
    labels = torch.rand(args.batch, device=device).round()
    turn = {"k": 0}

    def step():
        ids = batches[turn["k"] % len(batches)]
        turn["k"] += 1
        out = coll(ids)  # [B, 26, D]
        if coll.caches:  # the next batch's rows move while this step runs
            coll.prefetch(batches[turn["k"] % len(batches)])
        loss = torch.nn.functional.binary_cross_entropy_with_logits((out * readout).sum((1, 2)), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    ms = median_ms(step, device, args.warmup, args.iters)
    for cache in coll.caches.values():
        cache.queued.clear()  # the prefetch the last step queued ahead
    result = {"samples_per_s": args.batch / ms * 1e3, "step_ms": ms, "host_tables": host_tables,
              "cache_rows": cache_rows, "cache_hit_rate": coll.cache_hit_rate(),
              "host_gib": sum(c.store.nbytes + sum(s.nbytes for s in c.host_state.values())
                              for c in coll.caches.values()) / GIB,
              "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None}
    del coll, opt
    release()
    return result


def main(argv: list[str] | None = None) -> dict:
    """Parse flags, time both sides, print and return the JSON record."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--row-cap", type=int, default=0, help="cap every table's rows (0: MLPerf's sizes)")
    p.add_argument("--budget-gib", type=float, default=32.0, help="GPU memory the cached side's tables may take")
    p.add_argument("--batches", type=int, default=8, help="distinct batches of ids, used in turn")
    p.add_argument("--lr", type=float, default=0.004)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="tiny tables on the CPU, a budget of 30%% of them")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    if args.small:
        args.batch, args.dim, args.row_cap, args.batches, args.warmup, args.iters = 32, 16, 20000, 4, 2, 5
    tables = dlrmv2_tables(args)
    total = sum(adagrad_bytes(t) for t in tables)
    budget = int(0.3 * total) if args.small else int(args.budget_gib * GIB)
    batches = [draw_ids([t.num_embeddings for t in tables], args.batch, "zipf", device, args.seed + k)
               for k in range(args.batches)]
    device_side = time_side(tables, batches, args, device, None)
    cached = time_side(tables, batches, args, device, budget)
    record = {"benchmark": "host_tier", "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "batch": args.batch, "dim": args.dim, "tables": len(tables), "ids_per_sample": sum(HOTNESS),
              "table_gib": total / GIB, "budget_gib": budget / GIB, "optimizer": "adagrad (row-wise)",
              "device_samples_per_s": device_side["samples_per_s"], "cached_samples_per_s": cached["samples_per_s"],
              "ratio": cached["samples_per_s"] / device_side["samples_per_s"],
              "cache_hit_rate": cached["cache_hit_rate"], "host_tables": cached["host_tables"],
              "cache_rows": cached["cache_rows"], "host_gib": cached["host_gib"],
              "gpu_peak_gib": {"device": device_side["gpu_peak_gib"], "cached": cached["gpu_peak_gib"]}}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
