"""benchmarks/dlrmv2_scale.py on the CPU: 2 gloo processes train the small DLRMv2 shape like one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "dlrmv2_scale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dlrmv2_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_two_processes_train_the_losses_and_auc_of_one(bench, tmp_path, capsys, monkeypatch):
    # the 100-id table row-wise, the other large ones whole, the small ones replicated: every placement
    (tmp_path / "plan.json").write_text(json.dumps({"tables": {"t_C21": "row"}}))
    done = _torchrun("--small", "--plan", str(tmp_path / "plan.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    two = json.loads(done.stdout.strip().splitlines()[-1])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    one = bench.main(["--small"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["world_size"] == 1
    assert two["world_size"] == 2 and two["batch_per_process"] == one["global_batch"] // 2 == 128
    assert {"table@0", "table@1", "row", "data"} <= set(two["plan"].values()) and two["plan"]["t_C21"] == "row"
    assert len(two["losses"]) == len(one["losses"]) == 4 and two["samples_per_s"] > 0
    assert max(abs(a - b) for a, b in zip(two["losses"], one["losses"])) < 1e-5
    assert abs(two["auc"] - one["auc"]) < 1e-6 and len(two["memory_gib_per_process"]) == 2

