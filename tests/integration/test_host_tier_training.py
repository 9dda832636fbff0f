"""`ctrflow train --embedding-memory-gib` on 2 gloo processes: table- and row-wise shards in host memory
with device caches train bitwise like the same run all on the devices, validate alike, and their
checkpoints (whole tables) resume on 1 process, with or without the host tier, as today (2 -> 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ctrflow.cli import main
from tests.fixtures.ranks import free_port, run_rank
from tests.fixtures.training import write_processed

pytestmark = pytest.mark.integration
BUDGET = ["--embedding-memory-gib", "0.002"]  # of ~15 MiB of tables with lazy Adam state, per process


def _argv(data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--batch-size", "64", "--eval-batch-size", "64",
            "--max-steps", str(steps), "--seed", "5", "--log-every", "1", "--device", "cpu", "--no-progress",
            *extra]


def _tensors(out: Path) -> dict[str, torch.Tensor]:
    step = out / (out / "latest").read_text().strip()
    meta = json.loads((step / "meta.json").read_text())
    files = [n for n in meta["sha256"] if n.startswith(("tables/", "table_state/"))]
    dense = torch.load(step / "dense.pt", weights_only=True)
    return {**{n: torch.load(step / n, weights_only=True) for n in files}, **dense}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", "none")
        env.delenv("RANK", raising=False)
        root = tmp_path_factory.mktemp("host_tier")
        data = write_processed(root / "data", train_rows=64 * 40, valid_rows=256, cardinality=3000)
        runs = [(free_port(), _argv(data, root / f"{sharding}_{where}", 30, "--sharding", sharding,
                                    *(BUDGET if where == "host" else [])))
                for sharding in ("table", "row") for where in ("host", "device")]
        mp.start_processes(run_rank, args=(runs,), nprocs=2, join=True, start_method="spawn")
        yield root


@pytest.mark.parametrize("sharding", ["table", "row"])
def test_two_processes_with_tables_in_host_memory_train_like_all_on_the_devices(root, sharding):
    host, device = root / f"{sharding}_host", root / f"{sharding}_device"
    plan = json.loads((host / "config.json").read_text())["plan"]["sharding_plan"]
    assert any(s["placement"] == "host" for entry in plan["tables"].values() for s in entry["shards"])
    got, expected = _tensors(host), _tensors(device)
    assert sorted(got) == sorted(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    summaries = [json.loads((out / "train_summary.json").read_text()) for out in (host, device)]
    assert summaries[0]["valid_auc"] == summaries[1]["valid_auc"]


def test_a_two_process_cached_checkpoint_resumes_on_one_process_either_way(root):
    for name in ("on_host", "on_device"):
        shutil.copytree(root / "row_host", root / name)
    data = root / "data"
    assert main(_argv(data, root / "on_host", 40, "--resume", str(root / "on_host"), *BUDGET)) == 0
    assert main(_argv(data, root / "on_device", 40, "--resume", str(root / "on_device"))) == 0
    got, expected = _tensors(root / "on_host"), _tensors(root / "on_device")
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
