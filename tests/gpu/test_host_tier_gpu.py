"""The host tier on a GPU: tables in pinned host memory with small GPU caches train like the same tables
all on the GPU (50 steps of every sparse optimizer, one-hot and multi-hot, the next batch prefetched on
the side stream or in line), and `ctrflow train --embedding-memory-gib` runs and records its placement."""

from __future__ import annotations

import json

import pytest
import torch

from ctrflow.cli import main
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.tables import TableConfig
from tests.fixtures.bags import bag_batches, bag_tables
from tests.fixtures.host_tier import cached_collection, train, whole, zipf_batches
from tests.fixtures.training import write_processed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ONE_HOT = [TableConfig("t_a", 5000, 4, "C1"), TableConfig("t_b", 3, 4, "C2"), TableConfig("t_c", 3000, 4, "C3")]
STEPS, BATCH = 50, 64


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


def test_train_on_a_gpu_keeps_tables_beyond_the_budget_in_host_memory(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=64 * 40, valid_rows=256, cardinality=3000)
    out = tmp_path / "ckpt"
    assert main(["train", "--data", str(data), "--out", str(out), "--batch-size", "64", "--eval-batch-size", "64",
                 "--max-steps", "30", "--device", "cuda", "--embedding-memory-gib", "0.004", "--no-progress",
                 "--tracking-uri", "none"]) == 0
    plan = json.loads((out / "config.json").read_text())["plan"]
    assert plan["embedding"] == "plain" and ", host " in plan["placement"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["valid_auc"] > 0.5
