"""The sharded collection in one process (no process group): the plain collection's numbers."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.optimizers import SparseOptimizer
from ctrflow.embedding.plan import plan_sharding
from ctrflow.embedding.sharded import ShardedEmbeddingCollection
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError

TABLES = [TableConfig("t_a", 9, 3, "C1"), TableConfig("t_b", 4, 3, "C2")]
IDS = torch.tensor([[8, 0], [2, 3], [2, 1]])


def _step(collection) -> dict[str, torch.Tensor]:
    opt = SparseOptimizer(collection, "lazy_adam", lr=0.1)
    out = collection(IDS)
    (out * torch.arange(out.numel()).view_as(out)).sin().sum().backward()
    opt.step()
    return {k: v.clone() for k, v in collection.full_weights().items()}


def test_one_process_sharded_collection_steps_like_the_plain_one():
    plain = EmbeddingCollection(TABLES, seed=4)
    sharded = ShardedEmbeddingCollection.from_collection(EmbeddingCollection(TABLES, seed=4), plan_sharding(TABLES, 1))
    torch.testing.assert_close(sharded(IDS), plain(IDS))
    expected, got = _step(plain), _step(sharded)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def test_sharded_collection_refuses_out_of_range_ids_naming_the_feature():
    sharded = ShardedEmbeddingCollection.from_collection(EmbeddingCollection(TABLES), plan_sharding(TABLES, 1))
    with pytest.raises(UserError, match="feature C2: id 4"):
        sharded(torch.tensor([[0, 4]]))
