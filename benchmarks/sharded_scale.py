"""Scale demonstration: DLRM with the MLPerf Criteo-1TB tables, sharded over 1..N GPUs.

    PYTHONPATH=src torchrun --nproc-per-node N benchmarks/sharded_scale.py [--dim 128] [--batch-size 65536]
        [--embedding fused|plain] [--precision bf16]
    PYTHONPATH=src python3 benchmarks/sharded_scale.py --device cpu --rows-scale 1e-5 --dim 8 --batch-size 64

Trains ctrflow's DLRM (bottom 13-512-256-D, top 1024-1024-512-256-1) with its tables placed by the
automatic planner (or `--sharding`), the dense part under DDP, on synthetic ids drawn on the device
(no loader; Zipf-skewed like `train_throughput.py`, or uniform). `--embedding fused` (the default
on CUDA with Triton): each rank's shards in one `FusedShardedEmbeddingCollection` (fused lookup and
update-in-backward behind the all-to-alls), `FusedDotInteraction`, aligned and compiled dense parts,
as the one-GPU fast path, the step started by the tables' lookups and exchanges (`forward_in_chunks`; the
bottom MLP runs under the all-to-all) and DLRM's interaction reading the exchange buffers in place
(`--no-in-place` gathers [b, 26, D] first; `--chunks N` splits the step into micro-batches, measured
slower on 4 H200s); each step also routes the next step's ids (`--route-ahead`) and sorts its rows for
the update and zeroes the replicas' sums in forward (`--work-ahead`); with `--graph` the dense gradients'
all-reduce has its own communicator (`--dense-comm`); `--profile DIR` writes per-kernel GPU times of
graph replays and the ATen ops (with shapes) of one eager step. `plain`: `ShardedEmbeddingCollection`
with sparse gradients and `SparseOptimizer`. Tables are initialised on their devices shard by shard, so no host ever holds a
whole table. A plan that does not fit the GPUs' free memory is reported (`"fits": false`) instead
of trained. Rank 0 prints the plan to stderr and one JSON line: plan, memory per GPU, samples/s,
world size. Imports only torch and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ctrflow.data.schema import SPARSE
from ctrflow.embedding.fused import ops
from ctrflow.embedding.fused.dense import align_linear_inputs
from ctrflow.embedding.fused.interaction import FusedDotInteraction
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.fused.sharded_model import forward_in_chunks, read_exchange_layout
from ctrflow.embedding.optimizers import SparseOptimizer, state_bytes
from ctrflow.embedding.parallelize import apply_data_parallel
from ctrflow.embedding.plan import (FUSED_REPLICATE_BYTES, REPLICATE_BYTES, Shard, device_memory_budget,
                                   plan_sharding)
from ctrflow.embedding.sharded import ShardedEmbeddingCollection
from ctrflow.embedding.tables import TableConfig, tables_for
from ctrflow.errors import UserError
from ctrflow.models import build_model, replace_module
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


def device_init(seed: int):
    """Per-shard uniform(-1/sqrt(n), 1/sqrt(n)) drawn on the target device (fast; not the plain init)."""
    def init(table: TableConfig, index: int, shard: Shard, device: torch.device) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(seed * 1000003 + index * 1009 + shard.rank)
        bound = 1.0 / math.sqrt(table.num_embeddings)
        weight = torch.empty(shard.num_rows, shard.num_cols, device=device)
        return weight.uniform_(-bound, bound, generator=gen)

    return init


def synthetic_batches(tables: list[TableConfig], batch: int, count: int, device, seed: int,
                      ids: str = "uniform") -> list[tuple]:
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
        out.append((dense, ids_batch, labels))
    return out


FUSED_RULES = {"sgd": "sgd", "adagrad": "rowwise_adagrad", "adam": "adam", "lazy_adam": "adam"}


def build(args, runtime, tables, plan):
    """The DLRM with sharded tables on this process's device, its dense part under DDP, and optimizers."""
    model = build_model("dlrm", [2] * len(SPARSE), args.dim, seed=args.seed,
                        bottom_mlp=(512, 256), top_mlp=(1024, 1024, 512, 256))
    group = dist.new_group(list(range(runtime.world_size))) if runtime.distributed else None
    if args.embedding == "fused":
        return build_fused(args, runtime, tables, plan, model, group)
    init = device_init(args.seed)
    model.embeddings = ShardedEmbeddingCollection(
        tables, plan, lambda t, i, s: init(t, i, s, runtime.device), group, runtime.device, check=False)
    model.to(runtime.device)
    if runtime.distributed:
        apply_data_parallel(model, runtime.device)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    return model, torch.optim.SGD(dense, lr=args.lr), SparseOptimizer(model, args.optimizer, lr=args.lr)


def build_fused(args, runtime, tables, plan, model, group):
    """The fast path's model: fused sharded tables (bf16 lookups under `--precision bf16`), fused
    interaction, aligned Linear inputs, compiled dense parts; one dense optimizer (the tables step
    themselves)."""
    bf16 = args.precision == "bf16" and runtime.device.type == "cuda"
    model.embeddings = FusedShardedEmbeddingCollection(
        tables, plan, group, runtime.device, optimizer=FUSED_RULES[args.optimizer], lr=args.lr,
        output_dtype=torch.bfloat16 if bf16 else torch.float32, seed=args.seed, check=False,
        overlap=not args.no_overlap)
    model.embeddings.work_ahead = args.work_ahead
    replace_module(model, "interaction", FusedDotInteraction.from_plain(model.interaction))
    args.in_place = args.in_place and read_exchange_layout(model)
    align_linear_inputs(model)
    if runtime.device.type == "cuda" and not args.no_compile:
        for name in ("dense_arch", "interaction", "over_arch"):
            replace_module(model, name, torch.compile(model.get_submodule(name)))
    model.to(runtime.device)
    if runtime.distributed and not args.graph:  # with --graph the step averages the dense gradients
        apply_data_parallel(model, runtime.device)
    return model, torch.optim.SGD(model.parameters(), lr=args.lr), None


class DenseAverage:
    """`--graph`'s average of the dense gradients over ranks (DDP is off): one all-reduce of their
    concatenation after backward. `comm` "shared": on the default communicator (queued behind the
    replicated tables' all-reduce); "own": on a communicator of its own (beside it). (Starting the
    top MLP's part from a gradient hook during backward failed under CUDA-graph capture: call 10.)"""

    def __init__(self, model, world: int, comm: str):
        self.world, self.work, self.flat = world, None, None
        self.group = dist.new_group(list(range(world))) if comm != "shared" else None
        self.params = [p for p in model.parameters() if p.requires_grad]

    def start(self) -> None:
        """Start the all-reduce of the parameters' gradients."""
        self.flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for it and write the averages into the parameters' `.grad`."""
        self.work.wait()
        grads = [p.grad for p in self.params]
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(self.flat.div_(self.world).split(
            [g.numel() for g in grads]), grads)])


def make_step(args, runtime, model, optimizers):
    """One training step (loss on the device); with `--graph` the dense gradients are averaged by
    one all-reduce of their concatenation (`DenseAverage`), started before the fused tables' update
    (which then runs beside it), and the whole step is replayed as a CUDA graph. `next_ids`:
    the next step's ids (`--route-ahead`)."""
    cuda = runtime.device.type == "cuda"
    tables = model.embeddings if isinstance(model.embeddings, FusedShardedEmbeddingCollection) else None
    average = None
    if args.graph and runtime.distributed:
        average = DenseAverage(model, runtime.world_size, args.dense_comm)
        if tables is not None:
            tables.update_in_backward = False

    def step(dense_x, ids, labels, next_ids=None):
        for opt in optimizers:
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.precision == "bf16"):
            logits = forward_in_chunks(model, dense_x, ids, args.chunks, next_ids)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        loss.backward()
        if average is not None:
            average.start()
            if tables is not None:
                tables.flush()
            average.finish()
        for opt in optimizers:
            if opt is not None:
                opt.step()
        return loss.detach()

    return step


def capture(step):
    """`step` captured once (after 3 warm-up steps on a side stream) and replayed; inputs are
    copied into the graph's static tensors."""
    graph, static, held = torch.cuda.CUDAGraph(), [], {}

    def run(*batch):
        if not static:
            static.extend(t.clone() for t in batch)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # next ids = these ids: the routing left for the capture is theirs
                    step(*static[:3], *static[1:2] * (len(static) - 3))
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # NCCL's watchdog thread runs on
                held["loss"] = step(*static)
        for dst, src in zip(static, batch):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return held["loss"]

    return run


def train(args, runtime, step, batches, first: int = 0) -> float:
    """Seconds per step over `args.steps` after `args.warmup` steps, from batch `first` on (with
    `--route-ahead` each step is also handed the next step's ids)."""
    cuda = runtime.device.type == "cuda"
    ahead = args.route_ahead and args.embedding == "fused"
    for i in range(first, first + args.warmup + args.steps):
        if i == first + args.warmup:
            if cuda:
                torch.cuda.synchronize()  # timing starts with an idle device
            start = time.perf_counter()
        nxt = (batches[(i + 1) % len(batches)][1],) if ahead else ()
        step(*batches[i % len(batches)], *nxt)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / max(args.steps, 1)


def profile_ops(args, runtime, step, batches) -> None:
    """Rank 0 writes the ATen ops of one eager step (after two), by input shape with their GPU time:
    what the kernels of a graph replay's profile came from (every rank steps)."""
    ahead = args.route_ahead and args.embedding == "fused"
    run = lambda i: step(*batches[i % 4], *((batches[(i + 1) % 4][1],) if ahead else ()))  # noqa: E731
    run(0), run(1)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        run(2)
        torch.cuda.synchronize()
    if runtime.is_main:
        with open(f"{args.profile}/ops-{args.embedding}-n{runtime.world_size}.txt", "w") as f:
            f.write(prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=40, max_shapes_column_width=70))


def profile(args, runtime, step, batches) -> None:
    """Three more steps under the profiler; rank 0 writes the per-kernel table (every rank steps)."""
    steps = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 3})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        train(steps, runtime, step, batches, first=args.warmup + args.steps)
    if runtime.is_main:
        with open(f"{args.profile}/sharded-{args.embedding}-n{runtime.world_size}.txt", "w") as f:
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


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns (and on rank 0 prints) the result record."""
    args = parse_args(argv)
    runtime = init_runtime(args.device)
    rows = [max(1, int(n * args.rows_scale)) for n in MLPERF_TABLES]
    tables = tables_for(rows, list(SPARSE), args.dim)
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
                      route_ahead=args.route_ahead, work_ahead=args.work_ahead,
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
    model, dense_opt, sparse_opt = build(args, runtime, tables, plan)
    batches = synthetic_batches(tables, args.batch_size, 4, runtime.device, args.seed + runtime.rank, args.ids)
    step = make_step(args, runtime, model, (dense_opt, sparse_opt))
    if args.profile and runtime.device.type == "cuda":
        profile_ops(args, runtime, step, batches)
    if args.graph and runtime.device.type == "cuda":
        step = capture(step)
    seconds = train(args, runtime, step, batches)
    if args.profile and runtime.device.type == "cuda":
        profile(args, runtime, step, batches)
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
    if runtime.distributed and record.get("graph"):
        # NCCL communicators captured in a CUDA graph hung in teardown (device call 4): leave at once
        sys.stderr.flush()
        os._exit(0)
    if runtime.distributed:
        dist.destroy_process_group()
    return record


if __name__ == "__main__":
    main()
