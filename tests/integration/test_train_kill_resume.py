"""A training process killed with SIGKILL resumes from its last checkpoint to the same weights; one
stopped with SIGINT (Ctrl-C) or SIGTERM (Kubernetes, KFP) checkpoints the step in flight, exits
with one line saying how to resume (130, 143), and `--resume` continues it exactly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ctrflow.checkpoint import load_model, resolve_checkpoint

from tests.fixtures.training import write_processed

pytestmark = pytest.mark.integration
ENV = {**os.environ, "MLFLOW_TRACKING_URI": "none"}


EPOCHS, EPOCH_STEPS = 4, 16  # 4096 rows / 256 a step


def command(data: Path, out: Path, *extra: str, epochs: int = EPOCHS) -> list[str]:
    return [sys.executable, "-m", "ctrflow", "train", "--data", str(data), "--out", str(out), "--batch-size", "256",
            "--epochs", str(epochs), "--checkpoint-every", "8", "--log-every", "8", "--eval-every", "1000",
            "--deterministic", "--threads", "1", "--no-progress", "--tracking-uri", "none", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_processed(tmp_path_factory.mktemp("data"), train_rows=4096, valid_rows=512, cardinality=30)


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> Path:
    """The same run, never interrupted."""
    out = tmp_path_factory.mktemp("straight") / "ckpt"
    subprocess.run(command(data, out), check=True, env=ENV, capture_output=True)
    return out


def last(out: Path) -> Path:
    """The run's newest step (`load_model` of a run folder reads its best)."""
    return resolve_checkpoint(out, pick="last")


def assert_same_weights(a: Path, b: Path) -> None:
    first, _, _ = load_model(last(a))
    second, _, _ = load_model(last(b))
    for (name, x), y in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(x, y), name


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def signal_when(proc: subprocess.Popen, ready, signum: int, timeout: float = 180) -> None:
    """Send `signum` to `proc` as soon as `ready()` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            proc.send_signal(signum)
            return
        time.sleep(0.01)
    pytest.fail("the run ended (or hung) before it could be signalled")


def test_sigkilled_run_resumes_to_the_weights_of_an_uninterrupted_run(data, straight, tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(data, killed), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "latest"
    signal_when(proc, lambda: latest.exists() and latest.read_text().strip() >= "step_00000024", signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    stopped_at = load_model(last(killed))[2]["step"]
    assert 24 <= stopped_at < EPOCHS * EPOCH_STEPS

    subprocess.run(command(data, killed, "--resume", str(killed)), check=True, env=ENV, capture_output=True)
    assert load_model(last(killed))[2]["step"] == EPOCHS * EPOCH_STEPS
    assert_same_weights(killed, straight)


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_checkpoints_the_step_in_flight_and_resume_continues_exactly(data, straight, tmp_path, signum, code):
    every = ("--checkpoint-every", "1000")  # checkpoints only at each epoch's end (steps 16k)
    out = tmp_path / "stopped"
    proc = subprocess.Popen(command(data, out, *every), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    signal_when(proc, lambda: 24 in logged_steps(out), signum)
    _, err = proc.communicate(timeout=120)

    assert proc.returncode == code, err
    meta = load_model(last(out))[2]
    step = meta["step"]
    assert 24 <= step < EPOCHS * EPOCH_STEPS
    assert (out / "latest").read_text().strip() == f"step_{step:08d}"  # the step in flight, not the epoch's end
    name = signal.Signals(signum).name
    assert err.strip().splitlines()[-1] == (
        f"ctrflow train: stopped: {name} at step {step}; checkpoint {out}/step_{step:08d} written: "
        f"run the same command with --resume {out} to continue")
    assert "Traceback" not in err

    resumed = subprocess.run(command(data, out, *every, "--resume", str(out)), env=ENV,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {out}/step_{step:08d} at step {step}" in resumed.stdout
    assert load_model(last(out))[2]["step"] == EPOCHS * EPOCH_STEPS
    assert_same_weights(out, straight)
    assert logged_steps(out) == logged_steps(straight)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(data, tmp_path):
    """Under torchrun the ranks agree: one rank's signal stops every rank after the same step, with
    one checkpoint between them, and only rank 0 prints the line."""
    out, port = tmp_path / "two", str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(command(data, out, "--device", "cpu", "--log-every", "1"), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    signal_when(procs[1], lambda: 3 in logged_steps(out), signal.SIGTERM)
    errs = [p.communicate(timeout=180)[1] for p in procs]

    assert [p.returncode for p in procs] == [143, 143], errs
    step = load_model(last(out))[2]["step"]
    assert step % 10 == 0 and 10 <= step < EPOCHS * EPOCH_STEPS  # the ranks compare their flags every 10 steps
    assert errs[0].strip().splitlines()[-1].startswith(f"ctrflow train: stopped: SIGTERM at step {step};")
    assert "stopped" not in errs[1] and "Traceback" not in errs[0] + errs[1]
