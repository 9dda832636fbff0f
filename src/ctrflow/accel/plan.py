"""The run plan: every `auto` of a `TrainConfig` resolved for this runtime and this model.

`plan_run(config, runtime, model)` decides, for a model from `build_model` (tables deferred), the
device, processes, fused or plain tables and their optimizers, the sharding plan, how the dense
gradients are averaged, CUDA graphs, compile, precision per layer kind and the loader, into a
`RunPlan`; `ctrflow.accel.accelerate.accelerate` then applies it. The plan reads the model's named parts
(`embeddings`, `linear_embeddings`, `interaction`) and the data it declares about itself
(`products_only`, `head_is_one_graph`), never its class. The plan is also the run's record: what the run
prints, writes into its checkpoints (`run_record`) and logs as tracker params (`tracked_params`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ctrflow.accel.dense import compile_scope, use_compile
from ctrflow.accel.fp8.linear import check_fp8_device
from ctrflow.accel.fused import FUSED_KINDS, FUSED_MIN_DIM, use_fused
from ctrflow.accel.graphs import use_graphs
from ctrflow.config import OptimConfig, TrainConfig
from ctrflow.embedding.fused.cached import move_threads
from ctrflow.embedding.optimizers import choose_kind, sparse_memory
from ctrflow.embedding.placement import HostTier, placement_summary
from ctrflow.embedding.plan import ShardingPlan
from ctrflow.errors import UserError
from ctrflow.models.layers import DotInteraction

if TYPE_CHECKING:
    from torch import nn

    from ctrflow.runtime import Runtime


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
    """Every choice of a run, resolved (no "auto"): what `accelerate` applies and the run records."""

    device: str = "cpu"  # cpu | cuda:N (this process's)
    processes: int = 1
    embedding: str = "plain"  # fused (tables train themselves in backward) | plain
    sparse_kinds: Mapping[str, str] = field(default_factory=dict)  # table -> its optimizer
    # N processes: which rank holds which rows of every table; with --embedding-memory-gib (any number of
    # processes) also which shards live in host memory with a device cache
    sharding: ShardingPlan | None = None
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
    # torch's CPU threads, where the run sets them (0: --threads or torch's default): fewer beside the
    # moves of fused tables in host memory on a GPU (`ctrflow.embedding.fused.cached.move_threads`)
    cpu_threads: int = 0

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
                "placement": placement_summary(self.sharding),
                "dense_sync": self.dense_sync, "cuda_graphs": _on(self.cuda_graphs), "compile": self.compile,
                **{f"precision.{k}": v for k, v in self.precision().items()},
                "align_linear": _on(self.align_linear), "exchange_in_place": _on(self.exchange_in_place),
                "loader": self.loader or "none", "cpu_threads": self.cpu_threads or torch.get_num_threads()}

    def sharding_summary(self) -> str:
        """"none" (one process), one sharding type, or tables per type ("table 20, data 6")."""
        if self.sharding is None or self.processes == 1:  # one process: a plan only for the placement
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


def plan_run(config: TrainConfig, runtime: Runtime, model: nn.Module, loader: str = "") -> RunPlan:
    """Resolve `config`'s choices for `runtime` and `model` (module doc); `loader`: the train split's,
    as the loop resolved it. Every process calls it (the sharding plan agrees on memory: collective)."""
    amp = autocast_dtype(config, runtime)  # refuses fp8 where the GPU has no fp8 tensor cores
    collections = [c for c in (model.embeddings, model.linear_embeddings) if c is not None]
    fused = use_fused(config, runtime) and model.embeddings.embedding_dim >= FUSED_MIN_DIM
    all_fused = fused and all(c.embedding_dim >= FUSED_MIN_DIM for c in collections)
    tiered = config.embedding_memory_gib is not None
    sharding = _plan_sharding(config, runtime, model, fused) if runtime.distributed or tiered else None
    host = sharding is not None and bool(sharding.on_host())
    if fused and host and runtime.distributed:  # sharded tables in host memory: the plain sharded path
        if config.embedding == "fused":
            raise UserError("--embedding fused serves tables in host memory in one process only; under torchrun "
                            "use --embedding auto or plain, or a larger --embedding-memory-gib")
        fused = all_fused = False
        sharding = _plan_sharding(config, runtime, model, fused)
    # row-wise tables make the all-to-all sizes depend on the ids: no graph, no in-place exchange (fused
    # host tables, one process, place each batch before the graph replays: `ctrflow.accel.graphs`)
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
        loader=loader, optim=_resolved_optim(config.optim, model),
        cpu_threads=move_threads() if fused and host and runtime.device.type == "cuda"
        and not config.threads else 0)


def autocast_dtype(config: TrainConfig, runtime: Runtime) -> torch.dtype | None:
    """The dense part's autocast dtype: `--precision auto` is bf16 on CUDA, fp32 (None) elsewhere;
    `fp8` is bf16 autocast with the large Linear products in fp8 (`ctrflow.accel.fp8.apply.apply_fp8`,
    which `accelerate` applies), refused with a UserError off a CUDA GPU of compute capability 8.9+."""
    if config.precision == "fp32" or (config.precision == "auto" and runtime.device.type != "cuda"):
        return None
    if config.precision not in ("auto", "bf16", "fp8"):
        raise UserError(f"--precision must be auto, fp32, bf16 or fp8, got {config.precision!r}")
    if config.precision == "fp8":
        check_fp8_device(runtime.device)
    return torch.bfloat16


def _resolved_optim(optim: OptimConfig, model: nn.Module) -> OptimConfig:
    """`optim` as the run applies it: no embedding L2 where the embeddings reach the output only through
    products of each other (`RankingModel.products_only`): DLRM without dense features on 200,000
    movielens-like rows validated at AUC 0.50 with it (the L2 held every table at zero), 0.77 without."""
    return replace(optim, embedding_l2=0.0) if model.products_only and optim.embedding_l2 else optim


def _plan_sharding(config: TrainConfig, runtime: Runtime, model: nn.Module, fused: bool) -> ShardingPlan:
    """The tables' placement over the processes (`--sharding`, `--plan`, memory) and, with
    `--embedding-memory-gib`, in device or host memory; the fused path's auto plan keeps large tables
    whole where they fit (static all-to-all sizes) and replicates tables up to 32 MiB (unless one moved
    whole evens out the ranks' lookups)."""
    from ctrflow.accel.parallelize import plan_model  # the sharded collections' code, for N processes only
    from ctrflow.embedding.plan import FUSED_REPLICATE_BYTES, REPLICATE_BYTES

    return plan_model(model, runtime.world_size, config.sharding, config.plan, runtime.device,
                      memory_of=sparse_memory(config.optim), large="table" if fused else "row",
                      replicate_bytes=FUSED_REPLICATE_BYTES if fused else REPLICATE_BYTES,
                      host_tier=host_tier(config, runtime.world_size))


def host_tier(config: TrainConfig, world_size: int) -> HostTier | None:
    """`--embedding-memory-gib` as the placement planner takes it (None: no host tier). A cache must
    hold the ids of a global train batch or of an evaluation batch from every process; dense Adam
    steps every row each step, so its tables stay on the device."""
    if config.embedding_memory_gib is None:
        return None
    optim = config.optim
    return HostTier(int(config.embedding_memory_gib * 2**30),
                    max(config.data.batch_size, config.data.eval_batch_size * world_size),
                    lambda t: choose_kind(t, optim.sparse, optim.large_table_rows) == "adam")


def describe_placement(config: TrainConfig, world_size: int) -> str:
    """The tables' sharding and placement as a run of `config` on `world_size` processes plans them on
    the plain path (the model built from the data's schema, its tables never drawn): what
    `--print-config` shows with `--embedding-memory-gib`."""
    from ctrflow.accel.parallelize import model_tables, plan_model
    from ctrflow.contract.schema import Schema
    from ctrflow.embedding.collection import deferred_tables
    from ctrflow.models import build_model

    m = config.model
    with deferred_tables():
        model = build_model(m.name, Schema.load(config.data.path), m.embedding_dim, seed=config.seed,
                            embedding_init_scale=m.embedding_init_scale, **m.arch_kwargs())
    memory_of = sparse_memory(config.optim)
    plan = plan_model(model, world_size, config.sharding, config.plan, memory_of=memory_of,
                      host_tier=host_tier(config, world_size))
    return plan.describe(model_tables(model), memory_of)


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
