"""Scale demonstration: DLRM with the MLPerf Criteo-1TB tables, sharded over 1..N GPUs.

    PYTHONPATH=src torchrun --nproc-per-node N benchmarks/sharded_scale.py [--dim 128] [--batch-size 65536]
    PYTHONPATH=src python3 benchmarks/sharded_scale.py --device cpu --rows-scale 1e-5 --dim 8 --batch-size 64

Trains ctrflow's DLRM (bottom 13-512-256-D, top 1024-1024-512-256-1) whose `embeddings` is a
`ShardedEmbeddingCollection` placed by the automatic planner (or `--sharding`), the dense part under
DDP, on synthetic uniform ids drawn on the device (no loader). Tables are initialised on their
devices shard by shard, so no host ever holds a whole table. A plan that does not fit the GPUs'
free memory is reported (`"fits": false`) instead of trained. Rank 0 prints the plan to stderr and
one JSON line: plan, memory per GPU, samples/s, world size. Imports only torch and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ctrflow.data.schema import SPARSE
from ctrflow.embedding.optimizers import SparseOptimizer, state_bytes
from ctrflow.embedding.parallelize import apply_data_parallel
from ctrflow.embedding.plan import Shard, device_memory_budget, plan_sharding
from ctrflow.embedding.sharded import ShardedEmbeddingCollection
from ctrflow.embedding.tables import TableConfig, tables_for
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.train.distributed import init_runtime

MLPERF_TABLES = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=65536, help="per process (global = this x world size)")
    p.add_argument("--rows-scale", type=float, default=1.0, help="multiply every table's rows (tiny CPU runs)")
    p.add_argument("--sharding", default="auto", choices=("auto", "table", "row", "column", "data"))
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad", "adam", "lazy_adam"))
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="autocast of the dense part")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="per process (default: free GPU memory)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def device_init(seed: int):
    """Per-shard uniform(-1/sqrt(n), 1/sqrt(n)) drawn on the target device (fast; not the plain init)."""
    def init(table: TableConfig, index: int, shard: Shard, device: torch.device) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed * 1000003 + index * 1009 + shard.rank)
        bound = 1.0 / math.sqrt(table.num_embeddings)
        weight = torch.empty(shard.num_rows, shard.num_cols, device=device)
        return weight.uniform_(-bound, bound, generator=gen)

    return init


def synthetic_batches(tables: list[TableConfig], batch: int, count: int, device, seed: int) -> list[tuple]:
    """`count` batches (dense [B,13], ids [B,26], labels [B]) with uniform ids, drawn on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.stack([torch.randint(0, t.num_embeddings, (batch,), generator=gen, device=device)
                           for t in tables], dim=1)
        dense = torch.log1p(torch.rand(batch, 13, generator=gen, device=device) * 100)
        labels = torch.randint(0, 2, (batch,), generator=gen, device=device).float()
        out.append((dense, ids, labels))
    return out


def build(args, runtime, tables, plan):
    """The DLRM with sharded tables on this process's device, its dense part under DDP, and optimizers."""
    model = build_model("dlrm", [2] * len(SPARSE), args.dim, seed=args.seed,
                        bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256))
    group = dist.new_group(list(range(runtime.world_size))) if runtime.distributed else None
    init = device_init(args.seed)
    model.embeddings = ShardedEmbeddingCollection(
        tables, plan, lambda t, i, s: init(t, i, s, runtime.device), group, runtime.device, check=False)
    model.to(runtime.device)
    if runtime.distributed:
        apply_data_parallel(model, runtime.device)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    return model, torch.optim.SGD(dense, lr=args.lr), SparseOptimizer(model, args.optimizer, lr=args.lr)


def train(args, runtime, model, optimizers, batches) -> float:
    """Seconds per step over `args.steps` after `args.warmup` steps."""
    cuda = runtime.device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.precision == "bf16")
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            if cuda:
                torch.cuda.synchronize()  # timing starts with an idle device
            start = time.perf_counter()
        dense, ids, labels = batches[i % len(batches)]
        with amp:
            logits = model(dense, ids)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / max(args.steps, 1)


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


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and on rank 0 prints) the result record."""
    args = parse_args(argv)
    runtime = init_runtime(args.device)
    rows = [max(1, int(n * args.rows_scale)) for n in MLPERF_TABLES]
    tables = tables_for(rows, list(SPARSE), args.dim)
    memory_of = lambda t: state_bytes(t, args.optimizer)  # noqa: E731
    budget = (int(args.memory_budget_gib * 2**30) if args.memory_budget_gib is not None
              else device_memory_budget(runtime.device))
    if budget is not None:
        budget = min(gather(budget, runtime))  # every rank must compute the same plan
    record = {"benchmark": "sharded_scale", "world_size": runtime.world_size, "device": _device_name(runtime),
              "dim": args.dim, "rows": sum(rows), "table_gib": sum(t.bytes for t in tables) / 2**30,
              "optimizer": args.optimizer, "precision": args.precision, "batch_per_process": args.batch_size,
              "global_batch": args.batch_size * runtime.world_size, "sharding": args.sharding}
    try:
        plan = plan_sharding(tables, runtime.world_size, args.sharding, budget, memory_of)
    except UserError as err:
        record.update(fits=False, error=str(err))
        return _emit(record, runtime)
    if runtime.is_main:
        print(plan.describe(tables, memory_of), file=sys.stderr, flush=True)
    model, dense_opt, sparse_opt = build(args, runtime, tables, plan)
    batches = synthetic_batches(tables, args.batch_size, 4, runtime.device, args.seed + runtime.rank)
    seconds = train(args, runtime, model, (dense_opt, sparse_opt), batches)
    record.update(fits=True, plan={t.name: _placement(plan.tables[t.name]) for t in tables},
                  planned_gib_per_process=[b / 2**30 for b in plan.bytes_per_rank(tables, memory_of)],
                  memory_gib_per_process=gather(memory_gib(runtime), runtime),
                  step_ms=seconds * 1e3, samples_per_s=record["global_batch"] / seconds)
    return _emit(record, runtime)


def _placement(tp) -> str:
    if tp.sharding == "table":
        return f"table@{tp.shards[0].rank}"
    return tp.sharding


def _device_name(runtime) -> str:
    return torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu"


def _emit(record: dict, runtime) -> dict:
    if runtime.is_main:
        print(json.dumps(record), flush=True)
    if runtime.distributed:
        dist.destroy_process_group()
    return record


if __name__ == "__main__":
    main()
