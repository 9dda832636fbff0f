"""`ctrflow train --embedding fused` (the fused collection's torch version on the CPU): it learns,
its checkpoints load on the plain path, and a resumed run continues the same trajectory."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.accel import fused as fused_path
from ctrflow.checkpoint import load_model, resolve_checkpoint
from ctrflow.checkpoint.tables import read_model_state, read_optimizer_state
from ctrflow.runtime import Runtime
from ctrflow.train.loop import train
from ctrflow.contract.features import Features
from tests.fixtures.training import write_processed

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("processed"), train_rows=2048, valid_rows=512, cardinality=30)


def config(data_dir, out, **kw) -> TrainConfig:
    return TrainConfig(out=str(out), data=DataConfig(path=str(data_dir), batch_size=256, prefetch=2),
                       model=ModelConfig(name="dlrm", embedding_dim=16), embedding="fused", progress=False,
                       log_every=1, epochs=3, deterministic=True, **kw)


def losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_fused_run_learns_and_its_checkpoint_loads_on_the_plain_path(data_dir, tmp_path):
    out = tmp_path / "fused"
    summary = train(config(data_dir, out, max_steps=16))
    assert summary["valid_auc"] > 0.55  # above chance after 16 small steps
    model, _schema, meta = load_model(out)  # evaluate/export's reader: a plain CPU model
    step_dir = resolve_checkpoint(out)
    saved = read_model_state(step_dir, meta)["tables"]  # one file per table, mapped when read
    assert meta["step"] == 16 and len(saved) == 26
    torch.testing.assert_close(model.embeddings.full_weights()["t_C1"], saved["embeddings.t_C1"])
    optim = read_optimizer_state(step_dir, meta)["sparse"]
    assert optim["kinds"]["t_C1"] == "lazy_adam" and optim["tables"]["t_C1"]["exp_avg"].shape == (30, 16)


def test_fused_resume_continues_the_same_trajectory(data_dir, tmp_path):
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    train(config(data_dir, straight, max_steps=10))
    train(config(data_dir, first, max_steps=6))
    train(config(data_dir, resumed, max_steps=10, resume=str(first)))
    expected, got = losses(straight), losses(resumed)
    for step in range(7, 11):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


def test_fused_path_takes_its_own_optimizer_state_and_refuses_what_it_lacks(data_dir, tmp_path):
    cfg = config(data_dir, tmp_path / "x", optim=OptimConfig(sparse="adagrad"))
    runtime = Runtime(0, 1, 0, torch.device("cpu"))
    assert fused_path.use_fused(cfg, runtime)
    model = build_model("deepfm", Features.categorical([30] * 26, 13), 16)
    found = fused_path.apply_fused(model, cfg.optim, torch.device("cpu"), None)
    assert list(found) == ["embeddings"]  # the dim-1 first-order tables stay plain
    assert isinstance(model.embeddings, FusedEmbeddingCollection)
    assert model.embeddings.row_state.optimizer == "rowwise_adagrad"
    with pytest.raises(UserError, match="adam"):
        fused_path.use_fused(config(data_dir, tmp_path / "y", optim=OptimConfig(sparse="adam")), runtime)
    auto = dataclasses.replace(config(data_dir, tmp_path / "z"), embedding="auto")
    assert not fused_path.use_fused(auto, runtime)  # auto: the CPU stays on the plain path


def test_fused_under_torchrun_takes_table_row_and_data_plans_but_not_columns(data_dir, tmp_path):
    runtime = Runtime(0, 2, 0, torch.device("cpu"))
    assert fused_path.use_fused(config(data_dir, tmp_path / "a", sharding="row"), runtime)
    with pytest.raises(UserError, match="column"):
        fused_path.use_fused(config(data_dir, tmp_path / "b", sharding="column"), runtime)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tables": {"t_C1": "column"}}))
    auto = dataclasses.replace(config(data_dir, tmp_path / "c", plan=str(plan)), embedding="auto")
    assert not fused_path.use_fused(auto, runtime)  # auto falls back to the plain sharded path
