"""`ctrflow train --embedding fused` on 2 gloo processes (the fused kernels' torch version) logs the
losses of 1 fused process, for table- and row-wise plans; its checkpoint resumes on 1 plain process
and continues the same trajectory (topology- and path-independent checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from ctrflow.cli import main

from tests.fixtures.training import write_processed

from tests.fixtures.ranks import free_port, losses, run_rank

pytestmark = pytest.mark.integration


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--batch-size", "32", "--max-steps", "12",
            "--log-every", "1", "--device", "cpu", "--no-progress", "--limit-eval-batches", "1",
            "--embedding-dim", "16", "--checkpoint-every", "6", "--sparse-optimizer", "lazy_adam", *extra]


def test_two_fused_processes_match_one_and_resume_on_the_plain_path(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    monkeypatch.delenv("RANK", raising=False)
    data = write_processed(tmp_path / "data", train_rows=640, valid_rows=64, cardinality=30)
    plans = {"table": ["--sharding", "table"], "row": ["--sharding", "row"]}
    runs = [(free_port(), _argv(data, tmp_path / name, "--embedding", "fused", *extra)) for name, extra in plans.items()]
    mp.start_processes(run_rank, args=(runs,), nprocs=2, join=True, start_method="spawn")
    assert main(_argv(data, tmp_path / "one", "--embedding", "fused")) == 0
    one = losses(tmp_path / "one")
    for name in plans:
        two = losses(tmp_path / name)
        assert len(two) == len(one) == 12
        assert max(abs(a - b) / abs(b) for a, b in zip(two, one)) <= 1e-5, name
    (tmp_path / "row" / "latest").write_text("step_00000006\n")
    assert main(_argv(data, tmp_path / "resumed", "--embedding", "plain", "--resume", str(tmp_path / "row"))) == 0
    resumed = losses(tmp_path / "resumed")
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed[6:], one[6:])) <= 1e-4
