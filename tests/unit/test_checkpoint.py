"""Checkpoints: what load_model returns predicts like the trained model; integrity and pruning."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.contract.schema import Schema
from ctrflow.contract.criteo import SPARSE
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.checkpoint import check_schema, load_model, restore_checkpoint, save_checkpoint
from ctrflow.runtime import init_runtime
from ctrflow.train.optim import build_optimizers
from ctrflow.contract.criteo import criteo_features

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

SCHEMA = Schema(cardinalities={c: 20 for c in SPARSE}, features=criteo_features({c: 20 for c in SPARSE}), freq_threshold=1, rows={"train": 1}, vocab_hash="abc")


def trained(name="deepfm", steps=3):
    cfg = TrainConfig(out="", data=DataConfig(path="x"), model=ModelConfig(name=name, embedding_dim=4),
                      optim=OptimConfig(lr=0.01), keep_checkpoints=2)
    model = build_model(name, SCHEMA, 4, **cfg.model.arch_kwargs())
    optimizers = build_optimizers(model, cfg.optim)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.rand(32, 13, generator=gen), torch.randint(0, 20, (32, 26), generator=gen),
             torch.randint(0, 2, (32,), generator=gen).float())
    for _ in range(steps):
        step(model, optimizers, batch)
    return cfg, model, optimizers, batch


def step(model, optimizers, batch):
    loss = F.binary_cross_entropy_with_logits(model(batch[0], batch[1]), batch[2])
    optimizers.zero_grad()
    loss.backward()
    optimizers.step()
    return loss.item()


def save(cfg, model, optimizers, out, at):
    return save_checkpoint(out, model, optimizers, {"step": at, "epoch": 0, "batch": at}, cfg, SCHEMA,
                           init_runtime("cpu"))


def test_load_model_predicts_exactly_like_the_trained_model(tmp_path):
    cfg, model, optimizers, batch = trained()
    save(cfg, model, optimizers, tmp_path, 3)
    loaded, schema, meta = load_model(tmp_path)
    assert not loaded.training and schema == SCHEMA and meta["step"] == 3
    with torch.no_grad():
        assert torch.equal(loaded(batch[0], batch[1]), model(batch[0], batch[1]))


def test_restored_optimizers_continue_like_the_uninterrupted_run(tmp_path):
    cfg, model, optimizers, batch = trained("dlrm")
    save(cfg, model, optimizers, tmp_path, 3)
    expected = [step(model, optimizers, batch) for _ in range(3)]
    fresh = build_model("dlrm", SCHEMA, 4, seed=7, **cfg.model.arch_kwargs())
    fresh_opt = build_optimizers(fresh, cfg.optim)
    assert restore_checkpoint(tmp_path, fresh, fresh_opt)["batch"] == 3
    assert [step(fresh, fresh_opt, batch) for _ in range(3)] == pytest.approx(expected, rel=1e-6)


def test_latest_names_the_newest_and_old_steps_are_pruned(tmp_path):
    cfg, model, optimizers, _ = trained("wide_deep", steps=1)
    for at in (1, 2, 3):
        save(cfg, model, optimizers, tmp_path, at)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert not list(tmp_path.glob(".tmp*"))


def test_a_changed_file_is_detected(tmp_path):
    cfg, model, optimizers, _ = trained("dcnv2", steps=1)
    step_dir = save(cfg, model, optimizers, tmp_path, 1)
    meta = json.loads((step_dir / "meta.json").read_text())
    assert set(meta["sha256"]) >= {"dense.pt", "optimizer.pt", "tables/embeddings.t_C1.pt"}
    with open(step_dir / "tables" / "embeddings.t_C1.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(UserError, match="embeddings.t_C1.pt: sha256 mismatch"):
        load_model(tmp_path)


def test_schema_mismatch_names_what_differs():
    other = Schema(cardinalities={**SCHEMA.cardinalities, "C7": 21},
                   features=criteo_features({**SCHEMA.cardinalities, "C7": 21}), freq_threshold=1, rows={}, vocab_hash="abd")
    with pytest.raises(UserError, match="C7 cardinality 20 != 21; vocab_hash"):
        check_schema(SCHEMA, other, "data/schema.json")


def test_not_a_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not a ctrflow checkpoint"):
        load_model(tmp_path)
