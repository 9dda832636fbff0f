"""`accelerate(model, plan, runtime)`: every rewrite that makes a built model fast, in one stated order,
in the manner of torchtitan's `parallelize_<model>`.

`ctrflow.accel.plan.plan_run` resolves the run's choices into a `RunPlan`; `accelerate` applies it to a
model from `build_model` (its tables deferred: drawn where they land), always in this order:

1. fp8 (`--precision fp8`): Linear layers >= 512 wide become `Fp8Linear`s, a cross-net interaction an
   `Fp8CrossNet` (`ctrflow.accel.fp8.apply.apply_fp8`);
2. aligned Linear (CUDA): inputs of a width not a multiple of 8 are zero-padded for the tensor cores
   (`ctrflow.accel.dense.align_linear_inputs`);
3. tables and interaction: one process, fused: `embeddings` becomes a `FusedEmbeddingCollection` drawn on
   the device; N processes, fused: the tables fuse as they are sharded (4.); both: a dot interaction
   becomes the fused one (`ctrflow.accel.fused`); one process: the tables the plan keeps in host memory
   get their host store and device cache (fused: slots of its buffer; plain:
   `ctrflow.accel.parallelize.apply_host_placement`; N processes: as they are sharded); collections left
   plain are drawn;
4. parallelize: N processes shard the tables by the plan (fused or plain sharded collections), the model
   moves to the device, DDP wraps the dense part where `dense_sync` is "ddp" (`ctrflow.accel.parallelize`);
5. exchange layout: the fused dot interaction reads the sharded exchange's buffers in place
   (`ctrflow.accel.exchange.read_exchange_layout`);
6. dense average: where `dense_sync` is "average" the step averages the dense gradients itself
   (`ctrflow.accel.dense_average.DenseAverage`, no DDP hooks: the whole step can be one CUDA graph);
7. compile: torch.compile of `head` or of each dense part (`ctrflow.accel.dense.compile_dense`).
The step itself is captured as one CUDA graph by the loop (`ctrflow.accel.graphs.GraphedStep`) where
the plan says so.

fp8 and alignment rewrite disjoint Linear layers (widths multiples of 16 against widths not multiples of
8); both come before the swaps so that the layers are found in the model as `build_model` made it, and
compile comes last so that it compiles the final modules. Every rewrite keeps the parameters and their
state-dict keys: optimizers, checkpoints and the plain path see the same weights. Rewrites reach their
targets through the model's named parts (`embeddings`, `interaction`, `over_arch`, ...), never its class.
The benchmarks call `accelerate` with plans of their own (fp8 rules, a compile scope, no alignment), on
models whose tables they made themselves (a fused or sharded collection is left as it is).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from ctrflow.accel.dense import align_linear_inputs, compile_dense
from ctrflow.accel.dense_average import DenseAverage
from ctrflow.accel.exchange import read_exchange_layout
from ctrflow.accel.fp8.apply import apply_fp8
from ctrflow.accel.fp8.cross import Fp8CrossNet
from ctrflow.accel.fp8.linear import GRAD_DTYPES
from ctrflow.accel.fused import apply_fused, fused_collections, sharded_options, swap_interactions
from ctrflow.accel.parallelize import apply_host_placement, parallelize
from ctrflow.accel.plan import Fp8Plan, RunPlan
from ctrflow.embedding.collection import materialize_tables
from ctrflow.models import split_parameters

if TYPE_CHECKING:
    from ctrflow.runtime import Runtime


@dataclass
class Built:
    """What `accelerate` made: the model to train, the collections that train themselves (by attribute:
    `FusedTables` takes them), the step's `DenseAverage` (or None) and what each rewrite changed."""

    model: nn.Module
    fused: dict[str, nn.Module]
    average: DenseAverage | None
    changes: dict[str, Any]


def accelerate(model: nn.Module, plan: RunPlan, runtime: Runtime) -> Built:
    """Apply `plan` to `model` in the module doc's order; collective with N processes (every rank
    calls it in the same order). Returns the `Built` run; `model` itself is rewritten in place."""
    fp8_layers = apply_fp8_plan(model, plan.fp8) if plan.fp8 is not None else 0
    aligned = align_linear_inputs(model) if plan.align_linear else 0
    if plan.embedding == "fused" and runtime.distributed:
        swap_interactions(model)  # the tables fuse as they are sharded
    elif plan.embedding == "fused":
        host = {name: s.cache_rows for name, s in plan.sharding.on_host()} if plan.sharding is not None else {}
        apply_fused(model, plan.optim, runtime.device, plan.amp, host)  # drawn straight into the device buffer
    if not runtime.distributed:
        apply_host_placement(model, plan.sharding, runtime.device)
        materialize_tables(model)  # what no faster path took (DeepFM's dim-1 first-order tables, the plain path)
    options = sharded_options(plan.optim, plan.amp) if plan.embedding == "fused" and runtime.distributed else None
    # only this process's shards reach the device, never whole tables
    model = parallelize(model, runtime, plan.sharding, options, data_parallel=plan.dense_sync == "ddp")
    in_place = read_exchange_layout(model) if plan.exchange_in_place else False
    fused = fused_collections(model)
    average = None
    if plan.dense_sync == "average":  # rank 0's dense values broadcast, as DDP does
        average = DenseAverage(split_parameters(model)[0], fused.values(), plan.dense_comm)
    compiled = compile_dense(model, plan.compile, plan.compile_mode) if plan.compile != "off" else False
    return Built(model, fused, average, {"fp8_layers": fp8_layers, "aligned_layers": aligned,
                                         "exchange_in_place": in_place, "compiled": compiled})


def apply_fp8_plan(model: nn.Module, fp8: Fp8Plan) -> int:
    """`apply_fp8` with `fp8`'s options; returns the number of layers now fp8."""
    options = {k: v for k, v in asdict(fp8).items() if k not in ("grad_dtype", "wgrad_beside")}
    layers = apply_fp8(model, grad_dtype=GRAD_DTYPES[fp8.grad_dtype], **options)
    if fp8.wgrad_beside:
        for cross in (m for m in model.modules() if isinstance(m, Fp8CrossNet)):
            cross.wgrad_beside = True
    return layers
