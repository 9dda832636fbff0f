"""Hybrid parallelism applied to a finished model: sharded embeddings + data-parallel dense layers.

The model never mentions parallelism. `parallelize(model, runtime, plan)` applies, in this order:
1. `apply_embedding_sharding`: every `EmbeddingCollection` becomes a `ShardedEmbeddingCollection`
   (model-parallel tables, all-to-all lookups) on its own process group;
2. the dense rest moves to the device;
3. `apply_data_parallel`: DDP (composable `replicate`) over the dense parameters only.
One code path for 1 and N processes: with one process nothing is sharded or wrapped.
With `fused` options the collections become `FusedShardedEmbeddingCollection`s instead (the fused
kernels on each rank's shards; table, row and data sharding).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.embedding.placement import HostTier, place_in_budget
from ctrflow.embedding.plan import (REPLICATE_BYTES, ShardingPlan, device_memory_budget, plan_sharding,
                                   read_plan_overrides)
from ctrflow.embedding.sharded import ShardedEmbeddingCollection
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError

if TYPE_CHECKING:
    from ctrflow.runtime import Runtime


def model_tables(model: nn.Module) -> list[TableConfig]:
    """Tables of every embedding collection in the model; names must be unique across collections."""
    tables, seen = [], set()
    for _path, module in model.named_modules():
        if isinstance(module, (EmbeddingCollection, ShardedEmbeddingCollection, FusedShardedEmbeddingCollection)):
            for t in module.tables:
                if t.name in seen:
                    raise ValueError(f"table name {t.name} appears in two embedding collections")
                seen.add(t.name)
                tables.append(t)
    return tables


def plan_model(model: nn.Module, world_size: int, sharding: str = "auto", plan_file: str | None = None,
               device: torch.device | str = "cpu", memory_budget: int | None = None,
               memory_of: Callable[[TableConfig], int] | None = None, large: str = "row",
               replicate_bytes: int = REPLICATE_BYTES, host_tier: HostTier | None = None) -> ShardingPlan:
    """The sharding plan of a model's tables: `--sharding` for all, `--plan FILE` per table
    (`large`, `replicate_bytes`: see `plan_sharding`).

    Memory per rank: `memory_budget` bytes, else free CUDA memory (the smallest over ranks,
    so every rank computes the same plan), else unlimited on CPU. With `host_tier`
    (`--embedding-memory-gib`) the tables are sharded without a memory limit and then placed within
    its budget, what does not fit in host memory with a device cache (`ctrflow.embedding.placement`).
    """
    tables = model_tables(model)
    overrides = read_plan_overrides(plan_file) if plan_file else None
    if host_tier is not None:
        plan = plan_sharding(tables, world_size, sharding, None, memory_of, overrides, replicate_bytes, large)
        return place_in_budget(plan, tables, host_tier, memory_of or (lambda t: t.bytes))
    budget = memory_budget if memory_budget is not None else device_memory_budget(device)
    if budget is not None and dist.is_initialized() and world_size > 1:
        t = torch.tensor([budget], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        budget = int(t.item())
    return plan_sharding(tables, world_size, sharding, budget, memory_of, overrides, replicate_bytes, large)


def apply_embedding_sharding(model: nn.Module, plan: ShardingPlan, group, device, check_ids: bool = True,
                             fused: dict | None = None) -> None:
    """Replace every `EmbeddingCollection` in the model by a sharded one, keeping its weights
    (`fused`: options of `FusedShardedEmbeddingCollection`, used instead for collections of dim >= 16)."""
    targets = [(path, m) for path, m in model.named_modules() if isinstance(m, EmbeddingCollection)]
    for path, coll in targets:
        if fused is not None and coll.tables[0].embedding_dim >= 16:  # tensor-core pre-reduction
            sharded = FusedShardedEmbeddingCollection.from_collection(coll, plan, group, device, check=check_ids,
                                                                      **fused)
        else:
            sharded = ShardedEmbeddingCollection.from_collection(coll, plan, group, device, check_ids)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, sharded)


def apply_host_placement(model: nn.Module, plan: ShardingPlan | None, device) -> None:
    """One process: the tables `plan` keeps in host memory get their host store and device cache
    (before the other tables are drawn: a host table is drawn into host memory only)."""
    host = dict(plan.on_host()) if plan is not None else {}
    for module in model.modules():
        if isinstance(module, EmbeddingCollection):
            for t in module.tables:
                if t.name in host:
                    module.place_on_host(t.name, host[t.name].cache_rows, device)


def apply_data_parallel(model: nn.Module, device: torch.device) -> None:
    """DDP over the dense parameters (composable: module names and state_dict keys stay the same)."""
    from torch.distributed._composable import replicate

    ignored = [m for m in model.modules()
               if isinstance(m, (ShardedEmbeddingCollection, FusedShardedEmbeddingCollection))]
    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    # buffers (interaction indices) are constants: no broadcast before every forward
    newer = "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    kwargs["forward_sync_buffers" if newer else "broadcast_buffers"] = False
    replicate(model, ignored_modules=ignored, **kwargs)


def parallelize(model: nn.Module, runtime: Runtime, plan: ShardingPlan | None = None, fused: dict | None = None,
                data_parallel: bool = True) -> nn.Module:
    """Hybrid parallelism, in place: for N processes the embedding tables are sharded by `plan`
    (`ctrflow.accel.plan.plan_run` makes it; `fused`: the fused sharded collections' options,
    `ctrflow.accel.fused.sharded_options`), the rest moves to the device and, with `data_parallel`, the
    dense part runs under DDP (`data_parallel=False`: the step averages the dense gradients itself,
    `DenseAverage`); for one process the model only moves to the device. Collective with N > 1:
    every rank calls it in the same order."""
    if not runtime.distributed:
        return model.to(runtime.device)
    if plan is None:
        raise ValueError("parallelize: N processes need a sharding plan")
    if plan.world_size != runtime.world_size:
        raise UserError(f"sharding plan is for {plan.world_size} ranks, this job has {runtime.world_size}")
    group = dist.new_group(list(range(runtime.world_size)))  # embedding traffic on its own communicator
    # fused tables skip the per-step id check (a host sync), as in one process: the loader checked the ids
    apply_embedding_sharding(model, plan, group, runtime.device, check_ids=fused is None, fused=fused)
    model.to(runtime.device)
    if data_parallel:
        apply_data_parallel(model, runtime.device)
    return model
