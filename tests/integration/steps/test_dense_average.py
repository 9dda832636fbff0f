"""Two gloo ranks on CPU: the loop's step with `DenseAverage` (dense gradients averaged by one
all-reduce, fused sharded tables updated at its `flush`, no DDP) trains DLRM exactly like the
same step under DDP (what `ctrflow train` runs eagerly): dense weights, tables and losses, over
several steps with Adam, on a plan with whole and replicated tables."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctrflow.loaders.batch import Batch
from ctrflow.accel.interaction import FusedDotInteraction
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.accel.exchange import read_exchange_layout
from ctrflow.accel.parallelize import apply_data_parallel
from ctrflow.embedding.plan import plan_sharding
from ctrflow.models import build_model, replace_module
from ctrflow.accel.dense_average import DenseAverage
from ctrflow.accel.fused import FusedTables
from ctrflow.train.loop import train_step
from ctrflow.train.optim import Optimizers
from ctrflow.contract.features import Features

pytestmark = pytest.mark.integration

SIZES = [5 + 3 * i for i in range(26)]


def _batches(rank: int, world: int, steps: int, batch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        dense = torch.rand(batch * world, 13, generator=gen)
        ids = torch.stack([torch.randint(0, n, (batch * world,), generator=gen) for n in SIZES], 1)
        labels = torch.randint(0, 2, (batch * world,), generator=gen).float()
        mine = slice(rank * batch, (rank + 1) * batch)
        out.append(Batch(dense[mine], ids[mine], labels[mine]))
    return out


def _train(rank: int, world: int, mode: str, steps: int = 4, batch: int = 24) -> dict:
    """DLRM on fused sharded tables (two whole, the rest replicated); `mode` "ddp" or "average"."""
    model = build_model("dlrm", Features.categorical(SIZES, 13), 16, seed=1, bottom_mlp=(32, 16), top_mlp=(32, 1))
    plan = plan_sharding(model.embeddings.tables, world, "auto", overrides={"t_C1": "table", "t_C9": "table"})
    coll = FusedShardedEmbeddingCollection.from_collection(model.embeddings, plan, device="cpu",
                                                           optimizer="adam", lr=0.05)
    model.embeddings = coll
    replace_module(model, "interaction", FusedDotInteraction.from_plain(model.interaction))
    assert read_exchange_layout(model)
    with torch.no_grad():  # other dense values on rank 1: both modes must start from rank 0's (a broadcast)
        for p in model.parameters():
            p.add_(rank)
    dense = torch.optim.Adam([p for p in model.parameters()], lr=0.01)
    optimizers = Optimizers(dense, None, [], (0.01, 0.05), FusedTables({"embeddings": coll}, "lazy_adam"))
    average = None
    if mode == "ddp":
        apply_data_parallel(model, torch.device("cpu"))
    else:
        average = DenseAverage(dense.param_groups[0]["params"], [coll])
    losses = []
    for b in _batches(rank, world, steps, batch):
        loss = train_step(model, b, optimizers, torch.device("cpu"), average=average)
        total = loss.clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "embeddings" not in k}
    return {"losses": losses, "dense": weights, "tables": coll.full_weights()}


def _worker(rank: int, world: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ddp, avg = _train(rank, world, "ddp"), _train(rank, world, "average")
        diff = max(float((ddp["dense"][k] - avg["dense"][k]).abs().max()) for k in ddp["dense"])
        tables = max(float((ddp["tables"][k] - avg["tables"][k]).abs().max()) for k in ddp["tables"])
        results[rank] = {"dense": diff, "tables": tables, "losses": (ddp["losses"], avg["losses"]),
                         "moved": max(float((ddp["dense"][k] - _train_start(k)).abs().max()) for k in ddp["dense"])}
    finally:
        dist.destroy_process_group()


def _train_start(key: str) -> torch.Tensor:
    """Rank 0's initial value of a dense parameter (what both modes start from)."""
    model = build_model("dlrm", Features.categorical(SIZES, 13), 16, seed=1, bottom_mlp=(32, 16), top_mlp=(32, 1))
    return model.state_dict()[key]


def test_averaged_step_equals_the_ddp_step(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    for rank in (0, 1):
        r = results[rank]
        # DDP divides each bucket by the world size before summing, DenseAverage after: <= 1 ulp apart
        assert r["dense"] <= 1e-6 and r["tables"] <= 1e-6, r
        assert max(abs(a - b) for a, b in zip(*r["losses"])) <= 1e-6, r
        assert r["moved"] > 1e-3  # the steps trained the dense layers
