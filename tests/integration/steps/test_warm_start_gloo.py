"""Two gloo ranks warm-start from a one-process checkpoint whose tables are smaller than the new data's
(grown vocabularies): sharded row-wise on the plain path and table-wise fused, they hold exactly the
weights and optimizer state a one-process warm start holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctrflow.config import OptimConfig
from ctrflow.models import build_model
from ctrflow.contract.schema import Schema
from ctrflow.runtime import Runtime, init_runtime
from ctrflow.train.optim import build_optimizers
from ctrflow.train.warm_start import warm_start
from tests.fixtures.checkpoint import assert_same, build_sharded, snapshot
from tests.fixtures.warm_start import config, make_days

pytestmark = pytest.mark.integration



@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """The two days and the day-0 checkpoint (`tests.fixtures.warm_start.make_days`)."""
    return make_days(tmp_path_factory.mktemp("warm"))


CASES = {"plain-row": (False, "row", "auto"), "fused-table": (True, "table", "lazy_adam")}


def warm_config(days, sparse: str):
    cfg = config(days["d1"], "", init_from=str(days["k0"]))
    return dataclasses.replace(cfg, optim=OptimConfig(lr=0.01, sparse_lr=0.05, sparse=sparse))


def one_process(days, sparse: str) -> dict:
    cfg, schema = warm_config(days, sparse), Schema.load(days["d1"])
    model = build_model("dlrm", schema, 16, seed=cfg.seed, **cfg.model.arch_kwargs())
    optimizers = build_optimizers(model, cfg.optim)
    warm_start(model, optimizers, cfg, schema, init_runtime("cpu"))
    return snapshot(model, optimizers)


def worker(rank, world, store, days, expected, failures):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        runtime = Runtime(rank, world, rank, torch.device("cpu"))
        schema = Schema.load(days["d1"])
        for name, (fused, sharding, sparse) in CASES.items():
            cfg = warm_config(days, sparse)
            model, optimizers = build_sharded(cfg, runtime, fused, sharding, seed=cfg.seed, schema=schema)
            warm_start(model, optimizers, cfg, schema, runtime)  # collective: the ranks split the checksums
            got = snapshot(model, optimizers)
            if rank == 0:
                try:
                    assert_same(got, expected[name])
                except AssertionError as err:
                    failures[name] = str(err)
    finally:
        dist.destroy_process_group()


def test_two_processes_load_a_one_process_checkpoint_with_grown_tables(days, tmp_path):
    expected = {name: one_process(days, sparse) for name, (_, _, sparse) in CASES.items()}
    old = Schema.load(days["d0"]).cardinalities
    assert expected["plain-row"]["weights"]["embeddings.t_userId"].shape[0] > old["userId"]  # grown
    failures = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), days, expected, failures), nprocs=2, join=True)
    assert dict(failures) == {}
