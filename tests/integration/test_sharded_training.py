"""`ctrflow train` on 2 gloo processes equals 1 process, for every sharding type; 2 -> 1 resume.

The two processes run the real entry point (`ctrflow.cli.main`) with torchrun's environment,
one run after another, so torch is imported once per process (about a minute in all on 2 cores,
hence integration).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from ctrflow.cli import main

from tests.fixtures.training import write_processed
from tests.fixtures.ranks import free_port, losses, run_rank

pytestmark = pytest.mark.integration

SHARDINGS = ("table", "row", "column", "data", "plan")
STEPS = 20


def _argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--batch-size", "32", "--max-steps", str(STEPS),
            "--log-every", "1", "--device", "cpu", "--no-progress", "--limit-eval-batches", "1",
            "--embedding-dim", "4", "--checkpoint-every", "10", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 1-process run, then every sharding on 2 processes; {name: checkpoint dir}."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", "none")
        env.delenv("RANK", raising=False)
        yield _run_all(tmp_path_factory.mktemp("sharded"))


def _run_all(root: Path) -> dict[str, Path]:
    data = write_processed(root / "data", train_rows=640, valid_rows=64, cardinality=30)
    (root / "plan.json").write_text(json.dumps({"tables": {"t_C1": "column", "t_C2": "row",
                                                           "t_C3": {"sharding": "table", "rank": 1}}}))
    extra = {"table": ["--sharding", "table"], "row": ["--sharding", "row"], "column": ["--sharding", "column"],
             "data": ["--sharding", "data"], "plan": ["--sharding", "table", "--plan", str(root / "plan.json"),
                                                      "--model", "deepfm"]}
    outs = {name: root / name for name in SHARDINGS}
    two = [(free_port(), _argv(data, outs[n], *extra[n])) for n in SHARDINGS]
    mp.start_processes(run_rank, args=(two,), nprocs=2, join=True, start_method="spawn")
    assert main(_argv(data, root / "one")) == 0
    assert main(_argv(data, root / "one_deepfm", "--model", "deepfm")) == 0
    return {"data": data, "one": root / "one", "one_deepfm": root / "one_deepfm", **outs}


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_two_processes_log_the_losses_of_one(runs, sharding):
    ref = losses(runs["one_deepfm" if sharding == "plan" else "one"])
    got = losses(runs[sharding])
    assert len(got) == len(ref) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-4


def test_two_process_checkpoint_resumes_on_one_process(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    out = tmp_path / "resumed"
    assert main(_argv(runs["data"], out, "--resume", str(runs["row"] / "step_00000010"))) == 0
    got, ref = losses(out), losses(runs["one"])
    assert len(got) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(got[10:], ref[10:])) <= 1e-4


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": "none", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    # --standalone: the rendezvous binds a port the OS picks (a port probed free first can be taken)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_module_entry_point_matches_one_process(runs, tmp_path):
    out = tmp_path / "torchrun"
    done = _torchrun("-m", "ctrflow", *_argv(runs["data"], out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sharding plan" in done.stdout
    got, ref = losses(out), losses(runs["one"])
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-4


def test_scale_benchmark_runs_on_two_processes():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sharded_scale.py"
    done = _torchrun(str(script), "--device", "cpu", "--rows-scale", "1e-2", "--dim", "8", "--batch-size", "32",
                     "--steps", "2", "--warmup", "1", "--memory-budget-gib", "0.1")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["world_size"] == 2 and record["fits"] and len(record["memory_gib_per_process"]) == 2
    assert {"row", "data"} <= set(record["plan"].values())
