"""The host tier on a GPU: tables in host memory with small GPU caches train like the same tables all on
the GPU (50 steps of every sparse optimizer, one-hot and multi-hot, the next batch prefetched on the side
stream or in line; the plain path, and the fused path's Triton kernels with the rows arriving moved in
bulk copies by a thread of their own and the rows leaving written by the GPU, or by the CPU where the
host table is not registered with CUDA), `ctrflow train --embedding-memory-gib` runs and records its
placement, its CUDA-graphed step training like its eager one, and on a machine with the host memory for
them (two H200s' machine) the MLPerf one-hot shape at dim 256 trains on one GPU that cannot hold it."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest
import torch

from ctrflow.cli import main
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import ops
from ctrflow.embedding.fused.cache import BUCKETS, SlotCache, count_buckets
from ctrflow.embedding.fused.cached import SPARE_CORES, move_threads
from ctrflow.embedding.tables import TableConfig
from tests.fixtures.bags import bag_batches, bag_tables
from tests.fixtures.host_tier import (cached_collection, fused_pair, fused_whole, train, train_fused, whole,
                                      zipf_batches)
from tests.fixtures.training import write_processed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ONE_HOT = [TableConfig("t_a", 5000, 4, "C1"), TableConfig("t_b", 3, 4, "C2"), TableConfig("t_c", 3000, 4, "C3")]
STEPS, BATCH = 50, 64
HOST_TIER = Path(__file__).resolve().parents[2] / "benchmarks" / "host_tier.py"
HOST_GIB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy_adam"])
@pytest.mark.parametrize("shape", ["one_hot", "multi_hot"])
@pytest.mark.parametrize("ahead", [False, True])
def test_cached_tables_on_a_gpu_train_like_tables_on_it(kind, shape, ahead):
    tables = ONE_HOT if shape == "one_hot" else bag_tables(4, scale=40)
    batches = (zipf_batches(tables, STEPS, BATCH, device="cuda") if shape == "one_hot"
               else [ids.cuda() for ids in bag_batches(tables, BATCH, STEPS)])
    plain = EmbeddingCollection(tables, seed=3).cuda()
    cached = cached_collection(tables, 4 * BATCH * 4, device="cuda")
    assert all(c.store.is_pinned() for c in cached.caches.values())
    expected = whole(plain, train(plain, batches, kind))
    got = whole(cached, train(cached, batches, kind, prefetch_ahead=ahead))
    assert 0.0 < cached.cache_hit_rate() < 1.0
    for key in expected:  # the same rows' arithmetic; the GPU's sums of duplicates may round apart
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.skipif(HOST_GIB < 200, reason="the tables' 180 GiB need the host memory of a two-GPU machine")
def test_the_one_hot_mlperf_shape_at_dim_256_trains_on_one_gpu_that_cannot_hold_its_tables(capsys):
    record = runpy.run_path(str(HOST_TIER))["main"](["--shape", "onehot-dim256", "--dense", "bf16", "--iters", "3",
                                                      "--max-warmup", "30"])
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert record["table_gib"] > gpu_gib > record["gpu_peak_gib"]["cached"]
    assert record["host_tables"] > 0 and record["host_gib"] > record["table_gib"] - gpu_gib
    assert record["cached_samples_per_s"] > 0 and record["gb_per_step"]["read"] > 0  # rows moved every step


def test_train_on_a_gpu_keeps_tables_beyond_the_budget_in_host_memory(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=64 * 40, valid_rows=256, cardinality=3000)
    out = tmp_path / "ckpt"
    assert main(["train", "--data", str(data), "--out", str(out), "--batch-size", "64", "--eval-batch-size", "64",
                 "--max-steps", "30", "--device", "cuda", "--embedding-memory-gib", "0.004", "--no-progress",
                 "--tracking-uri", "none"]) == 0
    plan = json.loads((out / "config.json").read_text())["plan"]
    assert plan["embedding"] == "fused" and ", host " in plan["placement"]  # the fused path serves host tables
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["valid_auc"] > 0.5


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("shape", ["one_hot", "multi_hot"])
@pytest.mark.parametrize("ahead", [False, True])
def test_fused_host_tables_on_a_gpu_train_like_tables_in_the_buffer(optimizer, shape, ahead):
    tables = [TableConfig(t.name, t.num_embeddings, 16, t.feature) for t in ONE_HOT] if shape == "one_hot" \
        else bag_tables(16, scale=40)
    batches = (zipf_batches(tables, STEPS, BATCH, device="cuda") if shape == "one_hot"
               else [ids.cuda() for ids in bag_batches(tables, BATCH, STEPS)])
    device, cached = fused_pair(tables, optimizer, 2 * BATCH * 4 + 1, device="cuda")
    assert ops.uses_kernels(cached.weight) and cached.host.stream is not None
    train_fused(device, batches)
    train_fused(cached, batches, prefetch_ahead=ahead)
    assert 0.0 < cached.cache_hit_rate() < 1.0
    expected, got = fused_whole(device), fused_whole(cached)
    for key in expected:  # the same kernels; the sort groups a row's duplicates by other row numbers
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("parts", [1, 2, 3])  # weights; row-wise Adagrad's sum; Adam's two moments
@pytest.mark.parametrize("writer", ["gpu", "cpu"])  # the host table registered, or not (CUDA refused it)
def test_a_cache_moves_rows_and_their_state_between_host_memory_and_the_gpu(parts, writer):
    shapes = [(1000, 128), (1000,), (1000, 128)][:parts]
    buffers = [torch.zeros(64, *shape[1:], device="cuda") for shape in shapes]
    cache = SlotCache(1000, 0, 64, False, buffers)
    assert cache.mapped
    cache.mapped = writer == "gpu"
    for h in cache.host:
        h.copy_(torch.randn(h.shape))
    cache.empty(buffers)
    slots = cache.place(torch.tensor([5, 999, 5, 0], device="cuda"), buffers, train=True)
    for h, b in zip(cache.host, buffers):
        assert torch.equal(b[slots].cpu(), h[[5, 999, 5, 0]])
        b[slots] += 1  # the step: the rows in the cache change, not yet in host memory
    changed = [h[[5, 999, 0]] + 1 for h in cache.host]
    for start in (100, 200, 300):  # the third evicts the first batch's rows (the cache keeps two batches')
        cache.place(torch.arange(start, start + 30, device="cuda"), buffers, train=False)
    torch.cuda.synchronize()
    assert int(cache.stats[3]) == 3  # written back: the three rows the training batch changed
    for h, rows in zip(cache.host, changed):
        assert torch.equal(h[[5, 999, 0]], rows)


@pytest.mark.parametrize("n", [1, 4095, 4097, 3_000_001])
def test_the_bucket_histogram_counts_like_torch(n):
    bucket = torch.randint(0, BUCKETS, (n,), device="cuda")
    bucket[: n // 2] = BUCKETS - 1  # most slots in one bucket, as in a full cache
    expected = torch.histc(bucket.double().cpu(), bins=BUCKETS, min=0, max=BUCKETS).long()
    assert torch.equal(count_buckets(bucket).long().cpu(), expected)


def test_train_fused_on_a_gpu_keeps_tables_beyond_the_budget_in_host_memory(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=64 * 40, valid_rows=256, cardinality=3000)
    out = tmp_path / "ckpt"
    assert main(["train", "--data", str(data), "--out", str(out), "--batch-size", "64", "--eval-batch-size", "64",
                 "--max-steps", "30", "--device", "cuda", "--embedding", "fused", "--embedding-memory-gib", "0.004",
                 "--eval-every", "10", "--no-progress", "--tracking-uri", "none"]) == 0
    plan = json.loads((out / "config.json").read_text())["plan"]
    assert plan["embedding"] == "fused" and ", host " in plan["placement"] and plan["cuda_graphs"] == "on"
    assert json.loads((out / "train_summary.json").read_text())["valid_auc"] > 0.5


def test_a_graphed_step_with_host_tables_trains_like_the_eager_one(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=256 * 40, valid_rows=1024, cardinality=20000)
    runs = {}
    for graphs in ("auto", "off"):
        out = tmp_path / graphs
        assert main(["train", "--data", str(data), "--out", str(out), "--batch-size", "256", "--eval-batch-size",
                     "256", "--max-steps", "40", "--device", "cuda", "--embedding", "fused", "--embedding-memory-gib",
                     "0.015", "--cuda-graphs", graphs, "--eval-every", "15", "--log-every", "1", "--no-progress",
                     "--tracking-uri", "none"]) == 0
        plan = json.loads((out / "config.json").read_text())["plan"]
        assert ", host " in plan["placement"] and plan["cuda_graphs"] == ("on" if graphs == "auto" else "off")
        # cores left to the threads beside the moves, the same in a second run in this process
        assert plan["cpu_threads"] == move_threads() <= max(1, len(os.sched_getaffinity(0)) - SPARE_CORES)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[graphs] = ([r["loss"] for r in rows if "loss" in r],
                        json.loads((out / "train_summary.json").read_text())["valid_auc"])
    (graphed, graphed_auc), (eager, eager_auc) = runs["auto"], runs["off"]
    assert len(graphed) == len(eager) == 40
    # the same kernels on the same slots, up to the tables' atomic adds and capturable Adam's arithmetic
    assert max(abs(a - b) for a, b in zip(graphed, eager)) < 1e-4, (graphed, eager)
    assert abs(graphed_auc - eager_auc) < 1e-4
