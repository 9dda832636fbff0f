"""Scale demonstration: DLRM with the MLPerf Criteo-1TB tables, sharded over 1..N GPUs.

    PYTHONPATH=src torchrun --nproc-per-node N benchmarks/sharded_scale.py [--dim 128] [--batch-size 65536]
        [--embedding fused|plain] [--precision bf16]
    PYTHONPATH=src python3 benchmarks/sharded_scale.py --device cpu --rows-scale 1e-5 --dim 8 --batch-size 64

Trains ctrflow's DLRM (bottom 13-512-256-D, top 1024-1024-512-256-1) with its tables placed by the
automatic planner (or `--sharding`), with the training loop's own step (`ctrflow.train.loop.train_step`),
the dense part under DDP (without `--graph`), on synthetic ids drawn on the device
(no loader; Zipf-skewed like `train_throughput.py`, or uniform). `--embedding fused` (the default
on CUDA with Triton): each rank's shards in one `FusedShardedEmbeddingCollection` (fused lookup and
update-in-backward behind the all-to-alls), `FusedDotInteraction`, aligned and compiled dense parts,
as the one-GPU fast path, the step started by the tables' lookups and exchanges (`forward_in_chunks`; the
bottom MLP runs under the all-to-all) and DLRM's interaction reading the exchange buffers in place
(`--no-in-place` gathers [b, 26, D] first; `--chunks N` splits the step into micro-batches, measured
slower on 4 H200s); each step also routes the next step's ids (`--route-ahead`) and sorts its rows for
the update and zeroes the replicas' sums in forward (`--work-ahead`; under `--graph` that work, the
replicas' sums and all-reduce and the tables' update run on a side stream beside the dense layers:
`--beside`); `--graph` is what `ctrflow train` runs under torchrun: no DDP, the step averages the dense gradients (`ctrflow.accel.dense_average.DenseAverage`,
on a communicator of its own unless `--dense-comm shared`) and is replayed as one CUDA graph
(`ctrflow.accel.graphs.GraphedStep`); `--profile DIR` writes per-kernel GPU times of
graph replays and the ATen ops (with shapes) of one eager step. `plain`: `ShardedEmbeddingCollection`
with sparse gradients and `SparseOptimizer`. Tables are initialised on their devices shard by shard, so no host ever holds a
whole table. A plan that does not fit the GPUs' free memory is reported (`"fits": false`) instead
of trained. Rank 0 prints the plan to stderr and one JSON line: plan, memory per GPU, samples/s,
world size. Imports only torch, ctrflow and `sharded_parts.py` (inputs, timing, profiles) beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ctrflow.contract.criteo import SPARSE
from ctrflow.embedding.fused import ops
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.optimizers import SparseOptimizer, state_bytes
from ctrflow.embedding.plan import FUSED_REPLICATE_BYTES, REPLICATE_BYTES, device_memory_budget, plan_sharding
from ctrflow.embedding.sharded import ShardedEmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.accel.accelerate import accelerate
from ctrflow.accel.plan import RunPlan
from ctrflow.runtime import close_runtime, init_runtime
from ctrflow.accel.graphs import GraphedStep
from ctrflow.train.loop import train_step
from ctrflow.train.optim import Optimizers
from ctrflow.contract.features import Features

sys.path.insert(0, str(Path(__file__).parent))
from sharded_parts import (MLPERF_TABLES, device_init, gather, memory_gib, profile_kernels,  # noqa: E402
                           profile_ops, synthetic_batches, time_steps)


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
    p.add_argument("--embedding", default="auto", choices=("auto", "fused", "plain"),
                   help="auto: fused on CUDA with Triton, else plain")
    p.add_argument("--ids", default="zipf", choices=("zipf", "uniform"), help="synthetic id distribution")
    p.add_argument("--large", default="table", choices=("table", "row"),
                   help="fused path, auto plan: large tables whole (static exchange sizes) or row-wise")
    p.add_argument("--no-compile", action="store_true", help="fused path: eager dense parts")
    p.add_argument("--no-overlap", action="store_true", help="fused path: update at once in backward")
    p.add_argument("--replicate-mib", type=float, default=None,
                   help="auto plan: replicate tables up to this size (default: 32 fused, 1 plain)")
    p.add_argument("--graph", action="store_true", help="fused path: the whole step as one CUDA graph")
    p.add_argument("--chunks", type=int, default=1,
                   help="fused path: micro-batches per step, every chunk's embedding exchange started before "
                        "the dense layers (one table update per step)")
    p.add_argument("--in-place", action=argparse.BooleanOptionalAction, default=True,
                   help="fused path, no row-wise tables: the interaction reads the exchange buffers in place "
                        "(no gather into [b, 26, D] forward, none out of it backward; default)")
    p.add_argument("--route-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="fused path, no row-wise tables: each step's ids all-to-all runs during the step before")
    p.add_argument("--work-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="fused path: sort the step's rows for the update and zero the replicas' sums in forward")
    p.add_argument("--beside", action=argparse.BooleanOptionalAction, default=True,
                   help="--graph: the tables' sorts, replicas' sums and update on a side stream beside the dense layers")
    p.add_argument("--dense-comm", default="own", choices=("shared", "own"),
                   help="--graph: the dense gradients' all-reduce on the default communicator (shared) or on "
                        "its own (own, beside the replicated tables' all-reduce)")
    p.add_argument("--profile", default="", help="folder: rank 0 writes a per-kernel GPU time table of 3 steps")
    args = p.parse_args(argv)
    if args.embedding == "auto":
        cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        args.embedding = "fused" if cuda and ops.triton is not None else "plain"
    if args.graph and args.embedding != "fused":
        p.error("--graph needs --embedding fused (the plain path reads sparse sizes on the host)")
    return args


FUSED_RULES = {"sgd": "sgd", "adagrad": "rowwise_adagrad", "adam": "adam", "lazy_adam": "adam"}


def build_run(args, runtime, tables, plan):
    """The DLRM with sharded tables on this process's device, built by `ctrflow.accel.accelerate.accelerate` (dense
    part under DDP, or without `DenseAverage` under `--graph`), its optimizers and step."""
    model = build_model("dlrm", Features.categorical([2] * len(SPARSE), 13), args.dim, seed=args.seed,
                        bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256))
    group = dist.new_group(list(range(runtime.world_size))) if runtime.distributed else None
    fused = args.embedding == "fused"
    if fused:
        bf16 = args.precision == "bf16" and runtime.device.type == "cuda"
        model.embeddings = FusedShardedEmbeddingCollection(
            tables, plan, group, runtime.device, optimizer=FUSED_RULES[args.optimizer], lr=args.lr,
            output_dtype=torch.bfloat16 if bf16 else torch.float32, seed=args.seed, check=False,
            overlap=not args.no_overlap)
        model.embeddings.work_ahead, model.embeddings.beside = args.work_ahead, args.beside
    else:
        init = device_init(args.seed)
        model.embeddings = ShardedEmbeddingCollection(
            tables, plan, lambda t, i, s: init(t, i, s, runtime.device), group, runtime.device, check=False)
    built = accelerate(model, run_plan(args, runtime, plan), runtime)
    args.in_place = built.changes["exchange_in_place"]
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    sparse = None if fused else SparseOptimizer(model, args.optimizer, lr=args.lr)  # fused: the tables step themselves
    optimizers = Optimizers(torch.optim.SGD(dense, lr=args.lr), sparse, [], (args.lr, args.lr))
    step = partial(train_step, average=built.average, chunks=args.chunks)
    return model, optimizers, GraphedStep(step) if args.graph and runtime.device.type == "cuda" else step


def run_plan(args, runtime, plan) -> RunPlan:
    """The plan of this benchmark's build: the fast path's (fused sharded tables, fused interaction reading
    the exchange in place, aligned and compiled dense parts; with `--graph` on several processes the step
    averages the dense gradients itself, `DenseAverage` started before the fused tables' update) or the
    plain one (sharded tables, DDP, nothing else)."""
    fused, cuda = args.embedding == "fused", runtime.device.type == "cuda"
    sync = "none" if not runtime.distributed else "average" if args.graph else "ddp"
    return RunPlan(device=str(runtime.device), processes=runtime.world_size, embedding=args.embedding, sharding=plan,
                   dense_sync=sync, dense_comm=args.dense_comm, align_linear=fused,
                   compile="parts" if fused and cuda and not args.no_compile else "off",
                   exchange_in_place=fused and args.in_place,
                   autocast="bf16" if args.precision == "bf16" and cuda else "fp32")


def runner(args, runtime, model, optimizers: Optimizers, step, batches):
    """Step i of the run on batch i mod 4; with `--route-ahead` each step also gets the next batch's ids."""
    amp = torch.bfloat16 if runtime.device.type == "cuda" and args.precision == "bf16" else None
    ahead = args.route_ahead and args.embedding == "fused"

    def run(i: int) -> torch.Tensor:
        nxt = batches[(i + 1) % len(batches)].sparse if ahead else None
        return step(model, batches[i % len(batches)], optimizers, runtime.device, amp, next_ids=nxt)

    return run


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and on rank 0 prints) the result record."""
    args = parse_args(argv)
    runtime = init_runtime(args.device)
    rows = [max(1, int(n * args.rows_scale)) for n in MLPERF_TABLES]
    tables = tables_for(Features.categorical(dict(zip(list(SPARSE), rows))).sparse, args.dim)
    memory_of = lambda t: state_bytes(t, args.optimizer)  # noqa: E731  (the fused state is no larger)
    budget = (int(args.memory_budget_gib * 2**30) if args.memory_budget_gib is not None
              else device_memory_budget(runtime.device))
    if budget is not None:
        budget = min(gather(budget, runtime))  # every rank must compute the same plan
    record = {"benchmark": "sharded_scale", "world_size": runtime.world_size, "device": _device_name(runtime),
              "dim": args.dim, "rows": sum(rows), "table_gib": sum(t.bytes for t in tables) / 2**30,
              "optimizer": args.optimizer, "precision": args.precision, "batch_per_process": args.batch_size,
              "global_batch": args.batch_size * runtime.world_size, "sharding": args.sharding,
              "embedding": args.embedding, "ids": args.ids}
    large = args.large if args.embedding == "fused" else "row"
    fused_default = FUSED_REPLICATE_BYTES if args.embedding == "fused" else REPLICATE_BYTES
    replicate = int(args.replicate_mib * 2**20) if args.replicate_mib is not None else fused_default
    record["replicate_mib"] = replicate / 2**20
    if args.embedding == "fused":
        record.update(large=large, overlap=not args.no_overlap, graph=args.graph, chunks=args.chunks,
                      route_ahead=args.route_ahead, work_ahead=args.work_ahead, beside=args.beside,
                      dense_comm=args.dense_comm if args.graph else "ddp",
                      compiled=runtime.device.type == "cuda" and not args.no_compile)
    try:
        plan = plan_sharding(tables, runtime.world_size, args.sharding, budget, memory_of,
                             replicate_bytes=replicate, large=large)
    except UserError as err:
        record.update(fits=False, error=str(err))
        return _emit(record, runtime)
    if runtime.is_main:
        print(plan.describe(tables, memory_of), file=sys.stderr, flush=True)
    model, optimizers, step = build_run(args, runtime, tables, plan)
    batches = synthetic_batches(tables, args.batch_size, 4, runtime.device, args.seed + runtime.rank, args.ids)
    cuda = runtime.device.type == "cuda"
    if args.profile and cuda:  # eager steps, before any capture
        profile_ops(args, runtime, runner(args, runtime, model, optimizers, getattr(step, "step", step), batches))
    run = runner(args, runtime, model, optimizers, step, batches)
    seconds = time_steps(run, args.warmup, args.steps, cuda)
    if args.profile and cuda:
        profile_kernels(args, runtime, run)
    if isinstance(step, GraphedStep):
        step.release()  # before the process group goes: NCCL waits for graphs holding its calls
    record.update(fits=True, plan={t.name: _placement(plan.tables[t.name]) for t in tables},
                  planned_gib_per_process=[b / 2**30 for b in plan.bytes_per_rank(tables, memory_of)],
                  memory_gib_per_process=gather(memory_gib(runtime), runtime),
                  step_ms=seconds * 1e3, samples_per_s=record["global_batch"] / seconds)
    if args.embedding == "fused":
        record["in_place"] = args.in_place  # false where the plan has row-wise tables
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
    close_runtime(runtime)  # any CUDA graph is released by now (NCCL's teardown waits for them)
    return record


if __name__ == "__main__":
    main()
