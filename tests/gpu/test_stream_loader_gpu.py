"""The streaming loader on CUDA (pinned windows, side-stream copies, gathers on the GPU) gives the
CPU path's batches, also after an epoch left half-way and across prefetched epochs; the evaluation
scan gives each process its rows in order; `ctrflow train --loader stream` runs on the GPU."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.fixtures.training import write_processed

from ctrflow.config import DataConfig, TrainConfig  # noqa: E402
from ctrflow.loaders.stream import StreamLoader  # noqa: E402
from ctrflow.loaders.stream_plan import ParquetIndex  # noqa: E402
from ctrflow.train.loop import train  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = write_processed(tmp_path_factory.mktemp("stream"), train_rows=20000, valid_rows=2000, cardinality=50,
                           parts=4)
    for part in sorted((root / "train").glob("part-*.parquet")):
        pq.write_table(pq.read_table(part), part, row_group_size=700)
    return root


def batches(root, device, epoch, start, **kw):
    loader = StreamLoader(ParquetIndex(root, "train"), 512, seed=4, window_rows=4096, table_sizes=[50] * 26,
                          device=device, threads=4, **kw)
    return [(b.dense.cpu(), b.sparse.cpu(), b.labels.cpu()) for b in loader.batches(epoch, start)]


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_cuda_stream_gives_the_cpu_batches(data, rank, world):
    cpu = batches(data, "cpu", 2, 3, rank=rank, world_size=world)
    gpu = batches(data, "cuda", 2, 3, rank=rank, world_size=world)
    assert len(cpu) == len(gpu) == 20000 // 512 - 3
    for a, b in zip(cpu, gpu):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def test_an_epoch_left_half_way_does_not_disturb_the_next(data):
    loader = StreamLoader(ParquetIndex(data, "train"), 512, seed=4, window_rows=4096, device="cuda", threads=4)
    for i, _ in enumerate(loader.batches(0)):
        if i == 10:
            break
    again = [b.sparse.cpu() for b in loader.batches(1)]
    assert all(torch.equal(x, y[1]) for x, y in zip(again, batches(data, "cpu", 1, 0)))


def test_train_streams_on_the_gpu(data, tmp_path):
    out = tmp_path / "out"
    cfg = TrainConfig(out=str(out), data=DataConfig(path=str(data), batch_size=1024, loader="stream",
                                                    shuffle_window=8192), device="cuda", epochs=1,
                      embedding="plain", compile="off", progress=False, log_every=5)  # the loader, not the kernels
    summary = train(cfg)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["step"] == 20000 // 1024 and np.isfinite(losses).all()


def test_prefetched_epochs_on_cuda_give_the_cpu_batches(data):
    loader = StreamLoader(ParquetIndex(data, "train"), 512, seed=4, window_rows=4096, table_sizes=[50] * 26,
                          device="cuda", threads=4, epochs=3)
    for epoch in range(3):
        got = [b.sparse.cpu() for b in loader.batches(epoch)]
        assert all(torch.equal(x, y[1]) for x, y in zip(got, batches(data, "cpu", epoch, 0)))
        assert len(got) == 20000 // 512


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_cuda_scan_gives_the_rows_in_order(data, rank, world):
    from ctrflow.loaders.memory import ParquetDataset
    from ctrflow.loaders.scan import ScanLoader

    loader = ScanLoader(ParquetIndex(data, "valid"), 256, rank=rank, world_size=world, table_sizes=[50] * 26,
                        device="cuda", window_rows=700, threads=4)
    got = list(loader.batches())
    assert all(b.sparse.is_cuda for b in got) and len(got) == len(loader)
    split = ParquetDataset(data, "valid")
    rows = slice(2000 * rank // world, 2000 * (rank + 1) // world)
    assert torch.equal(torch.cat([b.sparse for b in got]).cpu(), torch.from_numpy(split.sparse[rows]).long())
    assert torch.equal(torch.cat([b.dense for b in got]).cpu(), torch.from_numpy(split.dense[rows]))
    assert torch.equal(torch.cat([b.labels for b in got]).cpu(), torch.from_numpy(split.labels[rows]))
