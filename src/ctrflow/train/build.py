"""The one build step of a training run, in the manner of torchtitan's `parallelize_<model>`.

`plan_run(config, runtime, model)` resolves every `auto` of a `TrainConfig`, for this runtime and this
model, into a `RunPlan`: device, processes, fused or plain tables and their optimizers, the sharding plan,
how the dense gradients are averaged, CUDA graphs, compile, precision per layer kind, the loader.
`build(model, plan, runtime)` then applies the plan to a model from `build_model` (its tables deferred:
drawn where they land), always in this order:

1. fp8 (`--precision fp8`): Linear layers >= 512 wide become `Fp8Linear`s, DCNv2's cross net an
   `Fp8CrossNet` (`ctrflow.train.fp8.apply_fp8`);
2. aligned Linear (CUDA): inputs of a width not a multiple of 8 are zero-padded for the tensor cores
   (`ctrflow.embedding.fused.dense.align_linear_inputs`);
3. tables and interaction: one process, fused: `embeddings` becomes a `FusedEmbeddingCollection` drawn on
   the device; N processes, fused: the tables fuse as they are sharded (4.); both: DLRM's dot interaction
   becomes the fused one (`ctrflow.train.fused`); collections left plain are drawn;
4. parallelize: N processes shard the tables by the plan (fused or plain sharded collections), the model
   moves to the device, DDP wraps the dense part where `dense_sync` is "ddp" (`ctrflow.train.distributed`);
5. exchange layout: DLRM's fused interaction reads the sharded exchange's buffers in place
   (`ctrflow.embedding.fused.sharded_model.read_exchange_layout`);
6. dense average: where `dense_sync` is "average" the step averages the dense gradients itself
   (`DenseAverage`, no DDP hooks: the whole step can be one CUDA graph);
7. compile: torch.compile of `head` (DCNv2) or of each dense part (`ctrflow.train.graphs.compile_dense`).

fp8 and alignment rewrite disjoint Linear layers (widths multiples of 16 against widths not multiples of
8); both come before the swaps so that the layers are found in the model as `build_model` made it, and
compile comes last so that it compiles the final modules. Every rewrite keeps the parameters and their
state-dict keys: optimizers, checkpoints and the plain path see the same weights. Rewrites reach their
targets through the model's typed parts (`RankingModel.embeddings`, `.interaction`, `.over_arch`, ...).
The benchmarks call `build` with plans of their own (fp8 rules, a compile scope, no alignment), on
models whose tables they made themselves (a fused or sharded collection is left as it is).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import nn

from ctrflow.config import OptimConfig, TrainConfig
from ctrflow.embedding.collection import materialize_tables
from ctrflow.embedding.fused.dense import align_linear_inputs
from ctrflow.embedding.fused.sharded_model import read_exchange_layout
from ctrflow.embedding.optimizers import choose_kind
from ctrflow.embedding.plan import ShardingPlan
from ctrflow.models import RankingModel
from ctrflow.models.layers import DotInteraction
from ctrflow.train.dense_average import DenseAverage
from ctrflow.train.distributed import Runtime, parallelize
from ctrflow.train.fp8 import GRAD_DTYPES, apply_fp8
from ctrflow.train.fused import (FUSED_KINDS, FUSED_MIN_DIM, apply_fused, autocast_dtype, fused_collections,
                                 sharded_options, swap_interactions, use_fused)
from ctrflow.train.graphs import compile_dense, compile_scope, use_compile, use_graphs
from ctrflow.train.optim import sparse_memory, split_parameters


@dataclass(frozen=True)
class Fp8Plan:
    """`apply_fp8`'s options; the defaults are `--precision fp8`'s (the benchmarks time the others)."""

    min_features: int = 512  # Linear layers with both widths at least this (and multiples of 16)
    rule: str = "all"  # all | widening: which of a layer's two products run in fp8
    fast_accum: bool = True
    rowwise: bool = True  # one scale per row (else per tensor)
    grad_dtype: str = "e5m2"  # e5m2 | e4m3
    fuse_cross: bool = True  # DCNv2's cross net in row kernels (`Fp8CrossNet`)
    absorb: bool = True  # ... computing the deep MLP's first layer too
    wgrad_beside: bool = False  # `Fp8CrossNet`'s weight-gradient products on a side stream


@dataclass(frozen=True)
class RunPlan:
    """Every choice of a run, resolved (no "auto"): what `build` applies and the run records."""

    device: str = "cpu"  # cpu | cuda:N (this process's)
    processes: int = 1
    embedding: str = "plain"  # fused (tables train themselves in backward) | plain
    sparse_kinds: Mapping[str, str] = field(default_factory=dict)  # table -> its optimizer
    sharding: ShardingPlan | None = None  # N processes: which rank holds which rows of every table
    dense_sync: str = "none"  # N processes: ddp | average (`DenseAverage` in the step); alone: none
    dense_comm: str = "own"  # average: the all-reduce on a communicator of its own | shared (the default one)
    cuda_graphs: bool = False  # the whole step replayed as one CUDA graph
    compile: str = "off"  # off | head (DCNv2) | parts (each dense part)
    compile_mode: str | None = None  # torch.compile's mode
    autocast: str = "fp32"  # the dense layers: bf16 (autocast) | fp32
    fp8: Fp8Plan | None = None  # the wide Linear layers in fp8
    align_linear: bool = False
    exchange_in_place: bool = False  # DLRM's fused interaction reads the all-to-all's buffers
    loader: str = ""  # the train split: "memory on DEVICE" | "stream"
    optim: OptimConfig = field(default_factory=OptimConfig)  # the fused tables' optimizer and learning rate

    @property
    def amp(self) -> torch.dtype | None:
        """The autocast dtype of the dense part (None: fp32, no autocast)."""
        return torch.bfloat16 if self.autocast == "bf16" else None

    def precision(self) -> dict[str, str]:
        """What each kind of layer computes in."""
        dense = "bf16 autocast" if self.autocast == "bf16" else "fp32"
        wide = (f"fp8 ({self.fp8.rule} products of Linear >= {self.fp8.min_features} wide"
                f"{', cross net in row kernels' if self.fp8.fuse_cross else ''})") if self.fp8 else dense
        lookups = ("bf16" if self.amp is not None else "fp32") if self.embedding == "fused" else "fp32"
        return {"dense": dense, "wide_linear": wide, "lookups": lookups, "tables": "fp32"}

    def record(self) -> dict[str, Any]:
        """The plan as flat strings and ints (the sharding per kind; `sharding.to_json()` has it per
        table): what the run prints, writes into its checkpoints and logs as tracker params."""
        return {"device": self.device, "processes": self.processes, "embedding": self.embedding,
                "sparse_optimizer": _counted(self.sparse_kinds.values()), "sharding": self.sharding_summary(),
                "dense_sync": self.dense_sync, "cuda_graphs": _on(self.cuda_graphs), "compile": self.compile,
                **{f"precision.{k}": v for k, v in self.precision().items()},
                "align_linear": _on(self.align_linear), "exchange_in_place": _on(self.exchange_in_place),
                "loader": self.loader or "none"}

    def sharding_summary(self) -> str:
        """"none" (one process), one sharding type, or tables per type ("table 20, data 6")."""
        if self.sharding is None:
            return "none"
        return _counted(tp.sharding for tp in self.sharding.tables.values())


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _counted(values) -> str:
    """One value, or each with its count, most frequent first: "lazy_adam 20, adam 6"."""
    counts = Counter(values).most_common()
    if len(counts) <= 1:
        return counts[0][0] if counts else "none"
    return ", ".join(f"{value} {n}" for value, n in counts)


def plan_run(config: TrainConfig, runtime: Runtime, model: RankingModel, loader: str = "") -> RunPlan:
    """Resolve `config`'s choices for `runtime` and `model` (module doc); `loader`: the train split's,
    as the loop resolved it. Every process calls it (the sharding plan agrees on memory: collective)."""
    amp = autocast_dtype(config, runtime)  # refuses fp8 where the GPU has no fp8 tensor cores
    collections = [c for c in (model.embeddings, model.linear_embeddings) if c is not None]
    fused = use_fused(config, runtime) and model.embeddings.embedding_dim >= FUSED_MIN_DIM
    all_fused = fused and all(c.embedding_dim >= FUSED_MIN_DIM for c in collections)
    sharding = _plan_sharding(config, runtime, model, fused) if runtime.distributed else None
    # row-wise tables make the all-to-all sizes depend on the ids: no graph, no in-place exchange
    static = sharding is None or all(sharding.tables[t.name].sharding != "row" for t in model.embeddings.tables)
    graphs = use_graphs(config, runtime, all_fused, static)
    dense_sync = "none" if not runtime.distributed else "average" if graphs else "ddp"
    compiled = fused and dense_sync != "ddp" and use_compile(config, runtime)  # DDP's hooks stay eager
    kinds = {t.name: FUSED_KINDS[config.optim.sparse][1] if fused and c.embedding_dim >= FUSED_MIN_DIM
             else choose_kind(t, config.optim.sparse, config.optim.large_table_rows)
             for c in collections for t in c.tables}
    return RunPlan(
        device=str(runtime.device), processes=runtime.world_size, embedding="fused" if fused else "plain",
        sparse_kinds=kinds, sharding=sharding, dense_sync=dense_sync, cuda_graphs=graphs,
        compile=compile_scope(model) if compiled else "off", autocast="bf16" if amp is not None else "fp32",
        fp8=Fp8Plan() if config.precision == "fp8" else None, align_linear=runtime.device.type == "cuda",
        exchange_in_place=(runtime.distributed and fused and static and type(model.interaction) is DotInteraction),
        loader=loader, optim=_resolved_optim(config.optim, model))


def _resolved_optim(optim: OptimConfig, model: RankingModel) -> OptimConfig:
    """`optim` as the run applies it: no embedding L2 where the embeddings reach the output only through
    products of each other (`RankingModel.products_only`): DLRM without dense features on 200,000
    movielens-like rows validated at AUC 0.50 with it (the L2 held every table at zero), 0.77 without."""
    return replace(optim, embedding_l2=0.0) if model.products_only and optim.embedding_l2 else optim


def _plan_sharding(config: TrainConfig, runtime: Runtime, model: RankingModel, fused: bool) -> ShardingPlan:
    """The tables' placement over the processes (`--sharding`, `--plan`, memory); the fused path's
    auto plan keeps large tables whole where they fit (static all-to-all sizes) and replicates tables
    up to 32 MiB."""
    from ctrflow.embedding.parallelize import plan_model
    from ctrflow.embedding.plan import FUSED_REPLICATE_BYTES, REPLICATE_BYTES

    return plan_model(model, runtime.world_size, config.sharding, config.plan, runtime.device,
                      memory_of=sparse_memory(config.optim), large="table" if fused else "row",
                      replicate_bytes=FUSED_REPLICATE_BYTES if fused else REPLICATE_BYTES)


@dataclass
class Built:
    """What `build` made: the model to train, the collections that train themselves (by attribute:
    `FusedTables` takes them), the step's `DenseAverage` (or None) and what each rewrite changed."""

    model: RankingModel
    fused: dict[str, nn.Module]
    average: DenseAverage | None
    changes: dict[str, Any]


def build(model: RankingModel, plan: RunPlan, runtime: Runtime) -> Built:
    """Apply `plan` to `model` in the module doc's order; collective with N processes (every rank
    calls it in the same order). Returns the `Built` run; `model` itself is rewritten in place."""
    fp8_layers = apply_fp8_plan(model, plan.fp8) if plan.fp8 is not None else 0
    aligned = align_linear_inputs(model) if plan.align_linear else 0
    if plan.embedding == "fused" and runtime.distributed:
        swap_interactions(model)  # the tables fuse as they are sharded
    elif plan.embedding == "fused":
        apply_fused(model, plan.optim, runtime.device, plan.amp)  # drawn straight into the device buffer
    if not runtime.distributed:
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
        from ctrflow.train.fp8_cross import Fp8CrossNet

        for cross in (m for m in model.modules() if isinstance(m, Fp8CrossNet)):
            cross.wgrad_beside = True
    return layers


def resolved_config(config: TrainConfig, plan: RunPlan) -> dict[str, Any]:
    """`config.to_dict()` with each `auto` replaced by what `plan` chose (the sharding and the sparse
    optimizer summarized per kind where tables differ): a record of the run, beside the config asked for."""
    out = config.to_dict()
    out.update(device=plan.device.split(":")[0], embedding=plan.embedding, sharding=plan.sharding_summary(),
               precision="fp8" if plan.fp8 else plan.autocast, cuda_graphs=_on(plan.cuda_graphs),
               compile=plan.compile)
    out["data"]["loader"] = plan.loader.split(" ")[0] if plan.loader else config.data.loader
    out["optim"]["sparse"] = _counted(plan.sparse_kinds.values())
    out["optim"]["embedding_l2"] = plan.optim.embedding_l2  # 0 where the model's embeddings meet only each other
    return out


def run_record(config: TrainConfig, plan: RunPlan) -> dict[str, Any]:
    """What a checkpoint's `config.json` holds: the config asked for, the one resolved, the plan
    (with the sharding plan per table)."""
    return {"asked": config.to_dict(), "resolved": resolved_config(config, plan),
            "plan": {**plan.record(), "sharding_plan": plan.sharding.to_json() if plan.sharding else None}}


def tracked_params(config: TrainConfig, plan: RunPlan) -> dict[str, Any]:
    """Tracker params: the resolved config's fields (`model.name`, `device`, ...) and the plan's (`plan.*`)."""
    resolved = resolved_config(config, plan)
    flat: dict[str, Any] = {}
    for key, value in resolved.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return {**flat, **{f"plan.{k}": v for k, v in plan.record().items()}}


__all__ = ["Built", "Fp8Plan", "RunPlan", "apply_fp8_plan", "build", "plan_run", "resolved_config", "run_record",
           "tracked_params"]
