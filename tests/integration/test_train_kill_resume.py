"""A training process killed with SIGKILL resumes from its last checkpoint to the same weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ctrflow.checkpoint import load_model

from tests.fixtures.training import write_processed

pytestmark = pytest.mark.integration


def command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ctrflow", "train", "--data", str(data), "--out", str(out), "--batch-size", "256",
            "--epochs", "12", "--checkpoint-every", "8", "--log-every", "8", "--eval-every", "1000",
            "--deterministic", "--threads", "1", "--no-progress", "--tracking-uri", "none", *extra]


def test_sigkilled_run_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=4096, valid_rows=512, cardinality=30)
    env = {**os.environ, "MLFLOW_TRACKING_URI": "none"}
    subprocess.run(command(data, tmp_path / "straight"), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(data, killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        latest = killed / "latest"
        if latest.exists() and latest.read_text().strip() >= "step_00000040":
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    stopped_at = load_model(killed)[2]["step"]
    assert 40 <= stopped_at < 192

    subprocess.run(command(data, killed, "--resume", str(killed)), check=True, env=env, capture_output=True)
    resumed, _, meta = load_model(killed)
    straight, _, _ = load_model(tmp_path / "straight")
    assert meta["step"] == 192
    for (name, a), b in zip(resumed.state_dict().items(), straight.state_dict().values()):
        assert torch.equal(a, b), name
