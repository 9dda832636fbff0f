"""NCCL on 2+ GPUs: the sharded collection equals the plain one (the CPU test's worker), and
`torchrun ... -m ctrflow train --device cuda` on 2 (and 4) GPUs logs the losses of 1 GPU for every
sharding (plain tables, fp32: the fused path and bf16 are one-process choices)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_sharding_parity import check_results, worker  # noqa: E402
from train_fixtures import write_processed  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
WORLDS = [2] + ([4] if torch.cuda.device_count() >= 4 else [])
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("world", WORLDS)
def test_n_gpus_match_plain_collection_for_every_sharding(tmp_path, world):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(world, str(tmp_path / "store"), results, "cuda"), nprocs=world, join=True)
    check_results(dict(results), 1e-5)  # CUDA's atomic index_add sums in any order


def _train(data: Path, out: Path, procs: int, *extra: str) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_TRACKING_URI": "none", "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
           str(port), "-m", "ctrflow", "train", "--data", str(data), "--out", str(out), "--batch-size", "256",
           "--max-steps", "20", "--log-every", "1", "--device", "cuda", "--no-progress",
           "--limit-eval-batches", "1", "--embedding", "plain", "--precision", "fp32", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """(data dir, per-step losses of one process): the reference every sharding is held to."""
    root = tmp_path_factory.mktemp("nccl")
    data = write_processed(root / "data", train_rows=256 * 20, valid_rows=256, cardinality=5000)
    return data, _train(data, root / "one", 1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sharding", ["table", "row", "column", "data"])
def test_n_gpus_log_the_losses_of_one(tmp_path, one_gpu, sharding, world):
    data, one = one_gpu
    many = _train(data, tmp_path / "many", world, "--sharding", sharding)
    assert len(many) == len(one) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(many, one)) <= 1e-4
