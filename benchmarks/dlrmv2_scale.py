"""MLPerf DLRMv2 on N GPUs: the hybrid-parallel step at the DLRMv2 shape, one global batch over the ranks.

    PYTHONPATH=src torchrun --nproc-per-node N benchmarks/dlrmv2_scale.py [--precision fp8|bf16]
        [--large table|row] [--plan FILE] [--batch-size 55296]
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/dlrmv2_scale.py --small   (a CPU, gloo)

The shape of `dlrmv2.py` (DCNv2 over the 26 multi-hot tables, 214 ids a sample), MLPerf's global batch
split evenly over the ranks (27,648 each on 2). Tables: placed by the automatic plan of the fused path (the
40 M-row tables whole, spread to even out the ids per rank, or row-wise with `--large row`; tables up to
32 MiB replicated) or per table by `--plan FILE` (`ctrflow train --plan`'s format), each rank's shards in
one `FusedShardedEmbeddingCollection` drawn on its device (multi-hot bags pooled by their owner before the
all-to-all, row-wise Adagrad in the backward). The step is `ctrflow train`'s (`ctrflow.train.loop.train_step`):
each step's lookups and exchanges start before the bottom MLP, the next step's ids are routed during this
one, and, where the plan is static (no row-wise table) on CUDA, the dense gradients are averaged by the
step itself (`DenseAverage`), the head is compiled, fp8 as `--precision fp8`, and the whole step is one
CUDA graph; otherwise DDP, eager. Alone (no torchrun) the same command times the one-GPU step:
`FusedEmbeddingCollection`, the same dense part and step.

`--profile DIR`: every rank's per-kernel GPU times of 3 more steps and its timeline. Rank 0 prints the
plan to stderr and one JSON line: samples/s, step time, world size, plan, peak memory
per process, the global-batch loss of every step and (`--eval-batches`, eager steps) the AUC of held-out
batches. `--small` (tables of at most 1000 rows, dim 16, global batch 256, fp32) draws the tables whole
and then shards them, so N processes start from the tables of one and must train to its losses and AUC.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ctrflow.accel.accelerate import accelerate
from ctrflow.accel.graphs import GraphedStep
from ctrflow.accel.plan import RunPlan
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.optimizers import state_bytes
from ctrflow.embedding.plan import FUSED_REPLICATE_BYTES, device_memory_budget, plan_sharding, read_plan_overrides
from ctrflow.loaders.batch import Batch
from ctrflow.models import build_model, split_parameters
from ctrflow.runtime import close_runtime, init_runtime
from ctrflow.train.loop import train_step
from ctrflow.train.optim import Optimizers

sys.path.insert(0, str(Path(__file__).parent))
from dlrmv2 import (ARCH, BATCH, HOTNESS, OPTIM, ROWS, dlrmv2_features, dlrmv2_tables, fast_tables,  # noqa: E402
                    make_batches)
from sharded_parts import gather, memory_gib, profile_kernels, time_steps  # noqa: E402
from train_paths import SMALL_ARCH, fp8_plan  # noqa: E402
from train_throughput import auc  # noqa: E402

PRECISION = {"fp8": "fp8 products of Linear >= 512 wide + bf16 autocast; bf16 lookups",
             "bf16": "bf16 autocast; bf16 lookups"}


def parse(argv=None) -> argparse.Namespace:
    """Command-line flags (defaults: the MLPerf shape, fp8, the automatic plan)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=BATCH, help="global: split evenly over the processes")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--precision", default="fp8", choices=("fp8", "bf16"), help="the dense part on CUDA (CPU: fp32)")
    p.add_argument("--large", default="table", choices=("table", "row"),
                   help="automatic plan: the large tables whole (static exchanges, a graphed step) or row-wise")
    p.add_argument("--plan", default="", help="per-table placements (a saved plan or {\"tables\": {...}})")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA, static plan: the whole step one CUDA graph, the head compiled")
    p.add_argument("--eval-batches", type=int, default=0, help="held-out batches scored after training (eager)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--profile", default="", help="folder: every rank's per-kernel GPU times of 3 more steps")
    p.add_argument("--small", action="store_true", help="tables of at most 1000 rows, dim 16, batch 256: a CPU")
    args = p.parse_args(argv)
    args.rows = list(ROWS)
    if args.small:
        args.rows = [min(n, 1000) for n in ROWS]
        args.dim, args.batch_size, args.warmup, args.steps = 16, 256, 1, 3
        args.eval_batches = args.eval_batches or 2
    args.no_align = False  # `train_paths.fp8_plan` reads these
    return args


def place_tables(args, runtime, tables):
    """The sharding plan (None alone): every rank computes the same one from the smallest free memory."""
    if not runtime.distributed:
        return None
    budget = device_memory_budget(runtime.device)
    budget = min(gather(budget, runtime)) if budget is not None else None
    overrides = read_plan_overrides(args.plan) if args.plan else None
    # `--small`: the capped tables (1000 rows) sharded, the smaller ones replicated, as at full size
    replicate = 999 * args.dim * 4 if args.small else FUSED_REPLICATE_BYTES
    return plan_sharding(tables, runtime.world_size, "auto", budget, lambda t: state_bytes(t, "adagrad"), overrides,
                         replicate, args.large)


def make_tables(args, runtime, tables, plan):
    """This process's tables: the whole fused collection alone; with N processes each rank's shards,
    drawn on its device shard by shard (`--small`: drawn whole on the host, then sharded)."""
    device, cuda = runtime.device, runtime.device.type == "cuda"
    if plan is None:
        return fast_tables(args, args.rows, device)
    group = dist.new_group(list(range(runtime.world_size)))  # the embedding traffic on its own communicator
    options = dict(optimizer=OPTIM[2], lr=OPTIM[3], output_dtype=torch.bfloat16 if cuda else torch.float32,
                   check=False)
    if args.small:
        whole = fast_tables(args, args.rows, torch.device("cpu"))
        return FusedShardedEmbeddingCollection.from_collection(whole, plan, group, device, **options)
    return FusedShardedEmbeddingCollection(tables, plan, group, device, seed=0, **options)


def build_run(args, runtime, tables, plan):
    """(model, optimizers, step, whether graphed): the DCNv2 of this shape on these tables, accelerated
    as `ctrflow train` does for this plan."""
    cuda = runtime.device.type == "cuda"
    static = plan is None or all(tp.sharding != "row" for tp in plan.tables.values())
    graph = cuda and static and args.graph
    model = build_model("dcnv2", dlrmv2_features([1] * len(ROWS), HOTNESS), args.dim,
                        **(SMALL_ARCH["dcnv2"] if args.small else ARCH))  # the dense layers; tables below
    model.embeddings = make_tables(args, runtime, tables, plan)
    sync = "none" if not runtime.distributed else "average" if graph else "ddp"
    run_plan = RunPlan(device=str(runtime.device), processes=runtime.world_size, embedding="fused", sharding=plan,
                       dense_sync=sync, cuda_graphs=graph, compile="head" if graph else "off",
                       autocast="bf16" if cuda else "fp32", align_linear=cuda,
                       fp8=fp8_plan(args, {"fp8"}) if cuda and args.precision == "fp8" else None)
    built = accelerate(model, run_plan, runtime)
    dense = torch.optim.Adam(split_parameters(model)[0], lr=OPTIM[1], capturable=graph, fused=cuda or None)
    optimizers = Optimizers(dense, None, [], (OPTIM[1], OPTIM[3]))
    step = partial(train_step, average=built.average)
    return model, optimizers, GraphedStep(step) if graph else step, graph


def rank_batches(args, runtime, count: int, seed: int) -> list[Batch]:
    """`count` global batches of `dlrmv2.make_batches` (the same on every rank), this rank's slice of each."""
    if args.batch_size % runtime.world_size:
        raise SystemExit(f"dlrmv2_scale: error: --batch-size {args.batch_size} does not split over "
                         f"{runtime.world_size} processes")
    b = args.batch_size // runtime.world_size
    whole = make_batches(args.rows, HOTNESS, args.batch_size, count, runtime.device, seed)
    return [Batch(*(t[runtime.rank * b:(runtime.rank + 1) * b].contiguous() for t in batch)) for batch in whole]


def train_and_time(args, runtime, model, optimizers, step, graph: bool) -> tuple[float, list[float]]:
    """Seconds per timed step, and every step's loss over the global batch (the ranks' mean)."""
    batches = rank_batches(args, runtime, 4, seed=0)
    amp = torch.bfloat16 if runtime.device.type == "cuda" else None
    losses: list[torch.Tensor] = []

    def run(i: int) -> torch.Tensor:
        # N processes, graphed: the next step's ids are routed during this one
        nxt = batches[(i + 1) % len(batches)].sparse if graph and runtime.distributed else None
        loss = step(model, batches[i % len(batches)], optimizers, runtime.device, amp, next_ids=nxt)
        losses.append(loss.clone())  # a graph's loss tensor is overwritten by its next replay
        return loss

    seconds = time_steps(run, args.warmup, args.steps, runtime.device.type == "cuda")
    if args.profile and runtime.device.type == "cuda":
        profile_kernels(args, runtime, run, f"dlrmv2-n{runtime.world_size}")
    mean = torch.stack(losses).double()
    if runtime.distributed:
        dist.all_reduce(mean)
    return seconds, (mean / runtime.world_size).tolist()


def held_out_auc(args, runtime, model) -> float:
    """AUC of the trained model over `--eval-batches` held-out global batches (each rank scores its slice)."""
    held = rank_batches(args, runtime, args.eval_batches, seed=2)
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(b.dense, b.sparse).float() for b in held])
    labels = torch.cat([b.labels for b in held])
    if runtime.distributed:  # the global batches again, in rank order
        scores, labels = (torch.cat(gather_tensor(t, runtime.world_size)) for t in (scores, labels))
    return auc(scores.cpu(), labels.cpu())


def gather_tensor(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """`t` of every process, in rank order (a collective)."""
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t)
    return parts


def main(argv=None) -> dict:
    """Run the benchmark; returns (and on rank 0 prints) the result record."""
    args = parse(argv)
    runtime = init_runtime(args.device)
    cuda = runtime.device.type == "cuda"
    tables = dlrmv2_tables(args.rows, HOTNESS, args.dim)
    plan = place_tables(args, runtime, tables)
    if plan is not None and runtime.is_main:
        print(plan.describe(tables, lambda t: state_bytes(t, "adagrad")), file=sys.stderr, flush=True)
    model, optimizers, step, graph = build_run(args, runtime, tables, plan)
    seconds, losses = train_and_time(args, runtime, model, optimizers, step, graph)
    record = {"benchmark": "dlrmv2_scale", "shape": "mlperf-dlrmv2", "world_size": runtime.world_size,
              "device": torch.cuda.get_device_name(runtime.device) if cuda else "cpu",
              "precision": PRECISION[args.precision] if cuda else "fp32", "small": args.small,
              "global_batch": args.batch_size, "batch_per_process": args.batch_size // runtime.world_size,
              "dim": args.dim, "table_rows": sum(args.rows), "ids_per_sample": sum(HOTNESS), "graph": graph,
              "plan": {t.name: placement(plan, t.name) for t in tables}, "step_ms": seconds * 1e3,
              "samples_per_s": args.batch_size / seconds, "losses": losses,
              "memory_gib_per_process": gather(memory_gib(runtime), runtime)}
    if args.eval_batches and not graph:  # a graphed step has routed ids ahead for a step that never comes
        record["auc"] = held_out_auc(args, runtime, model)
    if isinstance(step, GraphedStep):
        step.release()  # before the process group goes: NCCL waits for graphs holding its calls
    if runtime.is_main:
        print(json.dumps(record), flush=True)
    close_runtime(runtime)
    return record


def placement(plan, name: str) -> str:
    """How the plan holds a table: "table@RANK", "row", "data" (one process: "whole")."""
    if plan is None:
        return "whole"
    tp = plan.tables[name]
    return f"table@{tp.shards[0].rank}" if tp.sharding == "table" else tp.sharding


if __name__ == "__main__":
    main()
