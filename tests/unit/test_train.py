"""The training loop through its real entry points: metrics, AUC, resume, NaN and bad-id stops."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ctrflow.cli import main
from ctrflow.config import DataConfig, TrainConfig
from ctrflow.errors import UserError
from ctrflow.checkpoint import load_model, resolve_checkpoint
from ctrflow.train.loop import train
from ctrflow.contract.features import Features
from tests.fixtures.training import write_processed

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("processed"), train_rows=4096, valid_rows=2048, cardinality=30)


def config(data_dir, out, **kw) -> TrainConfig:
    return TrainConfig(out=str(out), data=DataConfig(path=str(data_dir), batch_size=256, prefetch=2),
                       progress=False, **kw)


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_logs_every_step_and_learns_above_chance(data_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    code = main(["train", "--data", str(data_dir), "--out", str(out), "--batch-size", "256", "--epochs", "2",
                 "--log-every", "1", "--eval-every", "10", "--no-progress", "--tracking-uri", "none"])
    assert code == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 33))
    assert all({"loss", "lr", "samples_per_s"} <= set(r) for r in records)
    aucs = [r["auc"] for r in records if "auc" in r]
    assert len(aucs) == 5  # steps 10, 16 (epoch end), 20, 30, 32
    # 32 steps: the default embedding rate (the dense one) learns slowly this early, and the default
    # schedule decays the second epoch's rate (0.618 here; 0.643 at a constant rate)
    assert aucs[-1] > 0.61
    lrs = [r["lr"] for r in records]  # the default schedule: epoch 1 at --lr, epoch 2 decaying towards 0
    assert lrs[:17] == [pytest.approx(1e-3)] * 17 and lrs[-1] == pytest.approx(1e-3 / 256)  # (1 - 15/16) ** 2
    assert all(a > b for a, b in zip(lrs[16:], lrs[17:]))
    assert np.mean([r["loss"] for r in records[-5:]]) < np.mean([r["loss"] for r in records[:5]])
    assert (out / "latest").read_text().strip() == "step_00000032"
    assert "valid auc" in capsys.readouterr().out


def test_resume_continues_the_same_trajectory(data_dir, tmp_path):
    straight = tmp_path / "straight"
    train(config(data_dir, straight, max_steps=12, log_every=1, epochs=3, deterministic=True))
    first = tmp_path / "first"
    train(config(data_dir, first, max_steps=7, log_every=1, epochs=3, deterministic=True))
    resumed = tmp_path / "resumed"
    train(config(data_dir, resumed, max_steps=12, log_every=1, epochs=3, deterministic=True, resume=str(first)))
    expected = {r["step"]: r["loss"] for r in read_metrics(straight)}
    got = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert sorted(got) == list(range(1, 13))  # steps 1-7 carried over from the first run
    for step in range(8, 13):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data_dir, tmp_path):
    bad = tmp_path / "bad"
    write_processed(bad, train_rows=4096, valid_rows=256, cardinality=30, parts=1)
    part = bad / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    i5 = table.column("I5").to_numpy().copy()
    i5[np.random.default_rng([0, 0]).permutation(4096)[5 * 256]] = np.inf  # the loader's 6th batch
    pq.write_table(table.set_column(table.column_names.index("I5"), "I5", pa.array(i5)), part)
    out = tmp_path / "ckpt"
    with pytest.raises(UserError, match="loss became"):
        train(config(bad, out, checkpoint_every=1, log_every=1, epochs=1))
    step_dir = resolve_checkpoint(out)
    model, _, meta = load_model(out)
    assert meta["step"] == 5
    assert all(np.isfinite(p.detach().numpy()).all() for p in model.parameters())
    assert step_dir.name == f"step_{meta['step']:08d}"


def test_bad_id_stops_the_cli_with_the_feature_named(tmp_path, capsys):
    root = write_processed(tmp_path / "data", train_rows=512, valid_rows=64, cardinality=30, parts=1)
    part = root / "valid" / "part-00000.parquet"
    table = pq.read_table(part)
    c26 = table.column("C26").to_numpy().copy()
    c26[3] = 30
    pq.write_table(table.set_column(table.column_names.index("C26"), "C26", pa.array(c26)), part)
    code = main(["train", "--data", str(root), "--out", str(tmp_path / "ckpt"), "--batch-size", "64",
                 "--tracking-uri", "none"])
    assert code == 2
    assert "row 3: C26 id 30" in capsys.readouterr().err


def test_resume_refuses_data_with_another_schema(data_dir, tmp_path):
    out = tmp_path / "ckpt"
    train(config(data_dir, out, max_steps=2))
    other = write_processed(tmp_path / "other", train_rows=1024, valid_rows=64, cardinality=31)
    with pytest.raises(UserError, match="C1 cardinality 30 != 31"):
        train(dataclasses.replace(config(other, tmp_path / "again", max_steps=4), resume=str(out)))


def test_lr_schedule_warms_up_then_decays_polynomially_to_the_end():
    from ctrflow.config import OptimConfig
    from ctrflow.train.optim import lr_factor

    cfg = OptimConfig(warmup_steps=4, decay_start_step=10, decay_power=2.0)
    factors = [lr_factor(step, cfg, total_steps=20, epoch_steps=5) for step in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4:11] == [1.0] * 7
    assert factors[15] == pytest.approx(0.25)  # (1 - 5/10) ** 2
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_lr_schedule_by_default_keeps_the_first_epoch_and_decays_the_later_ones_to_zero():
    from ctrflow.config import OptimConfig
    from ctrflow.train.optim import lr_factor

    cfg = OptimConfig()  # the defaults: decay from the end of epoch 1, power 2, down to 0
    two_epochs = [lr_factor(step, cfg, total_steps=20, epoch_steps=10) for step in range(20)]
    assert two_epochs[:11] == [1.0] * 11  # all of epoch 1, and the first step of epoch 2
    assert two_epochs[15] == pytest.approx(0.25)  # (1 - 5/10) ** 2
    assert two_epochs[19] == pytest.approx(0.01)  # the last step: (1 - 9/10) ** 2
    three_epochs = [lr_factor(step, cfg, total_steps=30, epoch_steps=10) for step in range(30)]
    assert three_epochs[:11] == [1.0] * 11 and three_epochs[20] == pytest.approx(0.25)  # over epochs 2 and 3
    # one epoch (the short runs, a warm-started day): a constant rate, as before the default changed
    assert [lr_factor(step, cfg, total_steps=48, epoch_steps=48) for step in range(48)] == [1.0] * 48
    # an explicit step wins; no epoch, no step: no decay
    assert lr_factor(10, OptimConfig(decay_start_step=5), total_steps=15, epoch_steps=10) == pytest.approx(0.25)
    flat = OptimConfig(decay_start_epoch=None)
    assert [lr_factor(step, flat, total_steps=20, epoch_steps=10) for step in range(20)] == [1.0] * 20


def test_resuming_a_finished_run_writes_a_checkpoint_without_training(data_dir, tmp_path):
    first = tmp_path / "first"
    train(config(data_dir, first, max_steps=3))
    summary = train(config(data_dir, tmp_path / "again", max_steps=3, resume=str(first)))
    assert summary["step"] == 3 and summary["valid_auc"] > 0.5
    assert load_model(tmp_path / "again")[2]["step"] == 3


def test_dense_adam_state_loads_whatever_kernels_the_saving_run_used():
    # a GPU run's checkpoint holds fused + capturable Adam groups; a CPU resume must not inherit them
    import torch

    from ctrflow.config import OptimConfig
    from ctrflow.models import build_model
    from ctrflow.train.optim import build_optimizers

    def run(flags: dict, state=None):
        torch.manual_seed(0)
        model = build_model("dlrm", Features.categorical([5] * 26, 13), 8, bottom_mlp=(16,), top_mlp=(8,))
        opts = build_optimizers(model, OptimConfig(dense="adam", sparse="sgd"))
        for group in opts.dense.param_groups:
            group.update(flags)
        if state is not None:
            opts.load_state_dict(state)
        dense, ids = torch.rand(4, 13), torch.randint(0, 5, (4, 26))
        for _ in range(2):
            opts.zero_grad()
            model(dense, ids).sum().backward()
            opts.step()
        return model, opts

    _, saver = run({"fused": True, "capturable": True})
    state = saver.state_dict()
    model, resumed = run({}, state)
    assert all(g["fused"] is None and not g["capturable"] for g in resumed.dense.param_groups)
    assert float(next(iter(resumed.dense.state.values()))["step"]) == 4.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
