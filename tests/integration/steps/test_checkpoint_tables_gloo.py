"""Two gloo ranks on CPU: a format-2 checkpoint of sharded tables (plain and fused) is written one whole
table at a time on rank 0, and resumes on 2 processes (another sharding) and on 1 process with the
same weights and optimizer state as before the save; the ranks split the checksums, and a bad file
one of them finds stops both. The same for a model with multi-hot bags (sum and mean) among its
one-hot tables."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.multiprocessing as mp

import ctrflow.embedding.fused.sharded_state as fused_state
import ctrflow.embedding.sharded as sharded
from ctrflow.embedding.tables import tables_for
from ctrflow.errors import UserError
from ctrflow.contract.features import Feature, Features
from ctrflow.models import build_model
from ctrflow.checkpoint import restore_checkpoint, save_checkpoint
from ctrflow.contract.schema import Schema
from ctrflow.runtime import Runtime
from ctrflow.train.optim import build_optimizers
from tests.fixtures.bags import bag_batches
from tests.fixtures.checkpoint import SCHEMA, assert_same, build_sharded, config, snapshot, train_steps

pytestmark = pytest.mark.integration

BAG_FEATURES = Features(dense=(Feature("I1", "dense", transform="log1p"), Feature("I2", "dense", transform="none")),
                        sparse=(Feature("C1", "categorical", 20), Feature("G", "multi_hot", 30, 4, "sum"),
                                Feature("C2", "categorical", 9), Feature("H", "multi_hot", 15, 3, "mean")))
BAG_SCHEMA = Schema(cardinalities=BAG_FEATURES.cardinalities(), features=BAG_FEATURES, freq_threshold=1,
                    rows={"train": 1}, vocab_hash="abc")
# name -> (sparse optimizer, fused, sharding when saved, sharding when resumed on 2 ranks, schema)
CASES = {"plain": ("lazy_adam", False, "row", "column", SCHEMA), "fused": ("adagrad", True, "row", "table", SCHEMA),
         "bags-plain": ("adagrad", False, "column", "row", BAG_SCHEMA),
         "bags-fused": ("lazy_adam", True, "row", "table", BAG_SCHEMA)}


class GatherLog:
    """Wraps `gather_whole` during a save: at every gather, how many whole tensors gathered before are
    still alive, and how many table files rank 0 has written so far."""

    def __init__(self, out):
        self.out, self.refs, self.calls = out, [], []
        self.original = sharded.gather_whole

    def __call__(self, *args, **kwargs):
        alive = sum(ref() is not None for ref in self.refs)
        written = sum(1 for d in ("tables", "table_state") for _ in self.out.glob(f".tmp-*/{d}/*.pt"))
        self.calls.append((alive, written))
        whole = self.original(*args, **kwargs)
        self.refs.append(weakref.ref(whole))
        return whole

    def __enter__(self):
        sharded.gather_whole = fused_state.gather_whole = self
        return self

    def __exit__(self, *exc):
        sharded.gather_whole = fused_state.gather_whole = self.original


def train_bag_steps(model, optimizers, rank: int, world: int, steps: int = 2) -> None:
    """`train_steps` for `BAG_SCHEMA`: global batches of 32 with padded and empty bags."""
    gen = torch.Generator().manual_seed(1)
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    for sparse in bag_batches(tables_for(BAG_FEATURES.sparse, 1), 32, steps, seed=2):
        dense = torch.rand(32, 2, generator=gen)
        labels = torch.randint(0, 2, (32,), generator=gen).float()
        loss = F.binary_cross_entropy_with_logits(model(dense[mine], sparse[mine]), labels[mine])
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()


def one_case(name, rank, world, out, results):
    sparse, fused, saved_as, resumed_as, schema = CASES[name]
    cfg = config(sparse, dim=16)
    runtime = Runtime(rank, world, rank, torch.device("cpu"))
    model, optimizers = build_sharded(cfg, runtime, fused, saved_as, schema=schema)
    if schema is SCHEMA:
        train_steps(model, optimizers, rank=rank, world=world)
    else:
        train_bag_steps(model, optimizers, rank, world)
    before = snapshot(model, optimizers)
    with GatherLog(out) as log:
        save_checkpoint(out, model, optimizers, {"step": 2, "epoch": 0, "batch": 2}, cfg, schema, runtime)
    again, again_opt = build_sharded(cfg, runtime, fused, resumed_as, seed=5, schema=schema)
    restore_checkpoint(out, again, again_opt, runtime=runtime)  # the ranks split the checksums
    assert_same(snapshot(again, again_opt), before)
    if rank == 0:
        one = build_model("dlrm", schema, cfg.model.embedding_dim, seed=7, **cfg.model.arch_kwargs())
        one_opt = build_optimizers(one, cfg.optim, None)  # one process, plain: no collective
        restore_checkpoint(out, one, one_opt)
        assert_same(snapshot(one, one_opt), before)
        results[name] = log.calls
    dist.barrier()
    if rank == 0:  # the second file in name order: rank 1 checks it, rank 0 must refuse too
        second = sorted(json.loads(next(out.glob("step_*/meta.json")).read_text())["sha256"])[1]
        path = next(out.glob("step_*")) / second
        path.write_bytes(path.read_bytes()[:-1] + b"x")
    dist.barrier()
    with pytest.raises(UserError, match="sha256 mismatch"):
        restore_checkpoint(out, again, again_opt, runtime=runtime)


def worker(rank, world, store, root, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for name in CASES:
            one_case(name, rank, world, root / name, results)
    finally:
        dist.destroy_process_group()


def test_sharded_save_holds_one_whole_table_and_resumes_on_two_and_one_process(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), tmp_path, results), nprocs=2, join=True)
    # per table: the weights, then each state tensor (lazy Adam 2, row-wise Adagrad 1)
    for name, tables, per_table in (("plain", 26, 3), ("fused", 26, 2), ("bags-plain", 4, 2), ("bags-fused", 4, 3)):
        calls = results[name]
        assert len(calls) == tables * per_table
        assert max(alive for alive, _ in calls) == 0  # every whole tensor dropped before the next gather
        assert [written for _, written in calls] == list(range(len(calls)))  # ... once its file was written
