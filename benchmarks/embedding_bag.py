"""Multi-hot embedding bags on one GPU: ctrflow's fused collection against `torch.nn.EmbeddingBag`.

    PYTHONPATH=src python3 benchmarks/embedding_bag.py                  # MLPerf DLRMv2 hotness, 1M rows a table
    PYTHONPATH=src python3 benchmarks/embedding_bag.py --table-rows mlperf --row-cap 4000000
    PYTHONPATH=src python3 benchmarks/embedding_bag.py --smoke          # tiny, on the CPU: seconds

The shape of MLPerf DLRMv2's multi-hot Criteo: 26 tables, bags of (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1,
6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1) ids (214 a sample, every bag full), sum pooling, batch
65,536, dim 128, fp32 tables; ids uniform over each table's rows (`--distribution zipf`: skewed, hot
rows repeat). One training step of the embeddings alone is timed both ways, in the same process:

- `fused`: `FusedEmbeddingCollection` (all tables in one buffer): the bag forward (gather and pool in
  one kernel) and the backward, which applies the optimizer inside (sort the 14 M ids, sum each
  distinct row's gradient, step it);
- `torch`: one `nn.EmbeddingBag(mode="sum", sparse=True)` per table, forward, backward (sparse
  gradients), then `torch.optim.SGD` / `torch.optim.SparseAdam`'s step.

The upstream gradient is a fixed random [B, 26, D] tensor. Each side's tables are built alone (the
other side's freed first), times are the median of `--iters` CUDA-event timings after `--warmup`
steps, and the ratio is torch / fused (above 1: the fused step is faster). With SGD both sides first
start from the same weights and their forward outputs are compared (`forward_max_rel_err`). Prints
one JSON line. Imports only torch and ctrflow.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from torch import nn

from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.contract.features import Feature

HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)  # MLPerf DLRMv2
MLPERF_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
               11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)  # its table sizes
OPTIMIZERS = {"sgd": ("sgd", lambda params, lr: torch.optim.SGD(params, lr=lr)),
              "adam": ("adam", lambda params, lr: torch.optim.SparseAdam(params, lr=lr))}


def table_sizes(args) -> list[int]:
    """Rows of each table: `--table-rows N` for all, or MLPerf's capped at `--row-cap`."""
    if args.table_rows == "mlperf":
        return [min(n, args.row_cap) if args.row_cap else n for n in MLPERF_ROWS]
    return [int(float(args.table_rows))] * len(HOTNESS)


def draw_ids(sizes: list[int], batch: int, distribution: str, device: torch.device, seed: int) -> torch.Tensor:
    """[B, 214] ids, table t's `HOTNESS[t]` slots in order, every bag full (ids >= 1: 0 is padding)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    columns = []
    for rows, hot in zip(sizes, HOTNESS):
        if distribution == "zipf":  # log-uniform: a few rows take most lookups
            u = torch.rand(batch, hot, generator=gen, device=device, dtype=torch.float64)
            ids = torch.exp(u * torch.log(torch.tensor(float(rows), dtype=torch.float64))).long()
        else:
            ids = torch.randint(1, max(rows, 2), (batch, hot), generator=gen, device=device)
        columns.append(ids.clamp(1, max(rows - 1, 1)))
    return torch.cat(columns, dim=1)


def median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU, the host clock elsewhere) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_fused(tables, optimizer: str, args, device: torch.device) -> FusedEmbeddingCollection:
    """The fused side: every table in one buffer on `device`, no id checks (a device-to-host read)."""
    return FusedEmbeddingCollection(tables, seed=args.seed, optimizer=optimizer, lr=args.lr, device=device,
                                    output_dtype=getattr(torch, args.output_dtype), check_ids=False)


def build_torch_bags(fused: FusedEmbeddingCollection | None, sizes: list[int], args,
                     device: torch.device) -> nn.ModuleList:
    """One `nn.EmbeddingBag` per table: copies of `fused`'s tables, or drawn like them."""
    bags = nn.ModuleList()
    for i, rows in enumerate(sizes):
        bag = nn.EmbeddingBag(rows, args.dim, mode="sum", sparse=True, device=device)
        with torch.no_grad():
            if fused is not None:
                bag.weight.copy_(fused.full_table(fused.tables[i].name))
            else:
                bag.weight.uniform_(-rows ** -0.5, rows ** -0.5)
        bags.append(bag)
    return bags


def torch_forward(bags: nn.ModuleList, ids_per_table: list[torch.Tensor]) -> torch.Tensor:
    """The torch side's lookup: each bag on its [B, hot] ids, stacked to [B, 26, D]."""
    return torch.stack([bag(ids) for bag, ids in zip(bags, ids_per_table)], dim=1)  # [B, 26, D]


def release() -> None:
    """Return freed device memory before the other side is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_fused(tables, name: str, ids: torch.Tensor, upstream: torch.Tensor, args, device: torch.device,
               out: dict) -> tuple[float, float, nn.ModuleList | None]:
    """(forward ms, step ms, torch bags holding the same weights when the optimizer is SGD): the
    fused side, freed when this returns. With SGD the two sides' lookups are compared first."""
    fused = build_fused(tables, OPTIMIZERS[name][0], args, device)
    bags = None
    if name == "sgd":  # the same weights on both sides (no optimizer state yet): their lookups must agree
        bags = build_torch_bags(fused, [t.num_embeddings for t in tables], args, device)
        with torch.no_grad():
            ref = torch_forward(bags, split_ids(ids))
            out["forward_max_rel_err"] = float((fused(ids).float() - ref).norm() / ref.norm())
    fused_upstream = upstream.to(fused.output_dtype)
    with torch.no_grad():
        forward = median_ms(lambda: fused(ids), device, args.warmup, args.iters)
    step = median_ms(lambda: fused(ids).backward(fused_upstream), device, args.warmup, args.iters)
    return forward, step, bags


def time_torch(bags: nn.ModuleList, name: str, ids: torch.Tensor, upstream: torch.Tensor, args,
               device: torch.device) -> tuple[float, float]:
    """(forward ms, step ms) of the torch side: `bags` and `torch.optim`'s step."""
    opt = OPTIMIZERS[name][1](list(bags.parameters()), args.lr)
    ids_per_table = split_ids(ids)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch_forward(bags, ids_per_table).backward(upstream)
        opt.step()

    with torch.no_grad():
        forward = median_ms(lambda: torch_forward(bags, ids_per_table), device, args.warmup, args.iters)
    return forward, median_ms(step, device, args.warmup, args.iters)


def split_ids(ids: torch.Tensor) -> list[torch.Tensor]:
    """Each table's [B, hot] ids, contiguous (an `nn.EmbeddingBag` input of fixed-length bags)."""
    starts = [0]
    for hot in HOTNESS:
        starts.append(starts[-1] + hot)
    return [ids[:, a:b].contiguous() for a, b in zip(starts, starts[1:])]


def run_optimizer(name: str, sizes: list[int], ids: torch.Tensor, upstream: torch.Tensor, args,
                  device: torch.device) -> dict:
    """Both sides' times under one optimizer (module doc), each side's memory freed before the other's."""
    features = [Feature(f"f{i}", "multi_hot", cardinality=n, max_length=h, pooling="sum")
                for i, (n, h) in enumerate(zip(sizes, HOTNESS))]
    out: dict = {}
    fused_forward, fused_step, bags = time_fused(tables_for(features, args.dim), name, ids, upstream, args, device,
                                                 out)
    release()
    torch_forward_ms, torch_step = time_torch(bags or build_torch_bags(None, sizes, args, device), name, ids,
                                              upstream, args, device)
    del bags
    release()
    batch = ids.shape[0]
    out.update(fused_step_ms=fused_step, torch_step_ms=torch_step, fused_forward_ms=fused_forward,
               torch_forward_ms=torch_forward_ms, ratio=torch_step / fused_step,
               forward_ratio=torch_forward_ms / fused_forward, fused_samples_per_s=batch / fused_step * 1e3,
               torch_samples_per_s=batch / torch_step * 1e3)
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--table-rows", default="1000000", help="rows of every table, or `mlperf` (its 26 sizes)")
    p.add_argument("--row-cap", type=int, default=None, help="with --table-rows mlperf: at most this many rows a table")
    p.add_argument("--optimizers", default="sgd,adam", help="comma-separated: sgd, adam")
    p.add_argument("--distribution", default="uniform", choices=("uniform", "zipf"))
    p.add_argument("--output-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the fused lookup's output dtype (its gradient's too)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (seconds): checks the script runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_size, args.dim, args.table_rows, args.warmup, args.iters = 32, 8, "50", 1, 2
        args.device = args.device or "cpu"
    return args


def main(argv=None) -> dict:
    """Time both sides for each optimizer; print and return the JSON record."""
    args = parse(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = table_sizes(args)
    ids = draw_ids(sizes, args.batch_size, args.distribution, device, args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    upstream = torch.randn(args.batch_size, len(HOTNESS), args.dim, generator=gen, device=device)
    record = {"benchmark": "embedding_bag", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "batch": args.batch_size, "dim": args.dim, "tables": len(HOTNESS),
              "ids_per_sample": sum(HOTNESS), "table_rows": sizes, "distribution": args.distribution,
              "output_dtype": args.output_dtype, "warmup": args.warmup, "iters": args.iters}
    for name in args.optimizers.split(","):
        if name not in OPTIMIZERS:
            raise SystemExit(f"--optimizers: unknown {name!r}; choose from {', '.join(OPTIMIZERS)}")
        record[name] = run_optimizer(name, sizes, ids, upstream, args, device)
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
