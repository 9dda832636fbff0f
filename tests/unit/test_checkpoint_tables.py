"""Checkpoint format 2 (a file per table and per optimizer state tensor): round trips on the plain and
fused paths for every sparse optimizer, format-1 checkpoints still read, and a missing or corrupt
table file is a UserError naming it. The two-process save/resume is in `test_checkpoint_tables_gloo.py`."""

from __future__ import annotations

import json

import pytest
import torch

from ctrflow.errors import UserError
from ctrflow.checkpoint import (load_model, model_meta, model_state, read_meta, restore_checkpoint, rng_state,
                                      save_checkpoint, sha256)
from ctrflow.checkpoint.tables import read_model_state
from ctrflow.runtime import init_runtime
from tests.fixtures.checkpoint import SCHEMA, assert_same, build, config, snapshot, train_steps

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

CASES = [("sgd", False), ("adagrad", False), ("adam", False), ("lazy_adam", False),
         ("sgd", True), ("adagrad", True), ("lazy_adam", True)]


def save(cfg, model, optimizers, out, at=2):
    return save_checkpoint(out, model, optimizers, {"step": at, "epoch": 0, "batch": at}, cfg, SCHEMA,
                           init_runtime("cpu"))


@pytest.mark.parametrize("sparse,fused", CASES)
def test_format_2_round_trip_restores_every_table_and_optimizer_state(tmp_path, sparse, fused):
    cfg = config(sparse)
    model, optimizers = build(cfg, fused)
    train_steps(model, optimizers)
    before = snapshot(model, optimizers)
    step_dir = save(cfg, model, optimizers, tmp_path)
    meta = read_meta(step_dir)
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {"meta.json"}
    assert meta["format"] == 2 and set(meta["sha256"]) == on_disk  # every file checksummed
    assert len(meta["files"]["tables"]) == 26
    table_bytes = SCHEMA.table_sizes()[25] * 16 * 4  # a file holds its table alone (not a fused buffer)
    assert table_bytes < (step_dir / "tables" / "embeddings.t_C26.pt").stat().st_size < table_bytes + 4096
    assert sorted(meta["files"]["table_state"]["t_C3"]) == sorted(before["sparse"]["t_C3"])
    again, again_opt = build(cfg, fused, seed=9)
    assert restore_checkpoint(tmp_path, again, again_opt)["step"] == 2
    assert_same(snapshot(again, again_opt), before)
    plain, _, _ = load_model(tmp_path)  # evaluate/export: the whole model, plain, on the CPU
    for name, w in before["weights"].items():
        assert torch.equal(plain.get_submodule(name.rpartition(".")[0]).full_weights()[name.rpartition(".")[2]], w)


def test_a_format_1_checkpoint_still_loads_and_resumes(tmp_path):
    cfg = config("lazy_adam", dim=4)
    model, optimizers = build(cfg, fused=False)
    train_steps(model, optimizers)
    before = snapshot(model, optimizers)
    step_dir = tmp_path / "step_00000002"  # the layout ctrflow wrote up to format 1
    step_dir.mkdir()
    torch.save(model_state(model), step_dir / "model.pt")
    torch.save(optimizers.state_dict(), step_dir / "optimizer.pt")
    torch.save(rng_state(), step_dir / "rng.pt")
    SCHEMA.save(step_dir / "schema.json")
    files = ("model.pt", "optimizer.pt", "rng.pt", "schema.json")
    meta = {"format": 1, "step": 2, "epoch": 0, "batch": 2, "model": model_meta(cfg), "config": cfg.to_dict(),
            "world_size": 1, "metrics": {}, "sha256": {n: sha256(step_dir / n) for n in files}}
    (step_dir / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "latest").write_text(step_dir.name + "\n")
    again, again_opt = build(cfg, fused=False, seed=9)
    assert restore_checkpoint(tmp_path, again, again_opt)["batch"] == 2
    assert_same(snapshot(again, again_opt), before)
    plain, _, _ = load_model(tmp_path)
    assert torch.equal(plain.embeddings.full_weights()["t_C7"], before["weights"]["embeddings.t_C7"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = config("adagrad", dim=4)
    model, optimizers = build(cfg, fused=False)
    train_steps(model, optimizers, steps=1)
    out = tmp_path_factory.mktemp("ckpt")
    return cfg, save(cfg, model, optimizers, out)


def test_a_missing_table_file_is_a_user_error_naming_it(saved, tmp_path):
    cfg, step_dir = saved
    copy = tmp_path / step_dir.name
    copy.mkdir()
    for p in step_dir.rglob("*"):
        if p.is_file() and p.name != "embeddings.t_C5.pt":
            (copy / p.relative_to(step_dir)).parent.mkdir(parents=True, exist_ok=True)
            (copy / p.relative_to(step_dir)).write_bytes(p.read_bytes())
    with pytest.raises(UserError, match=r"tables/embeddings.t_C5.pt: missing from the checkpoint"):
        load_model(copy)


def test_a_corrupt_table_or_state_file_is_a_user_error_naming_it(saved):
    cfg, step_dir = saved
    state_file = step_dir / "table_state" / "t_C2.sum.pt"
    good = state_file.read_bytes()
    state_file.write_bytes(good[:-8] + b"xxxxxxxx")
    try:
        model, optimizers = build(cfg, fused=False)
        with pytest.raises(UserError, match=r"table_state/t_C2.sum.pt: sha256 mismatch"):
            restore_checkpoint(step_dir, model, optimizers)
    finally:
        state_file.write_bytes(good)
    table_file = step_dir / "tables" / "embeddings.t_C9.pt"
    good = table_file.read_bytes()
    table_file.write_bytes(b"not a torch file")
    try:  # unverified reads (the sha256 check skipped) still name the file
        tables = read_model_state(step_dir, read_meta(step_dir, verify=False))["tables"]
        with pytest.raises(UserError, match=r"embeddings.t_C9.pt: not a readable checkpoint file"):
            tables["embeddings.t_C9"]
    finally:
        table_file.write_bytes(good)
