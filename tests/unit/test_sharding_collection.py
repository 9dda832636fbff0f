"""The sharded collection in one process (no process group): the plain collection's numbers."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import INIT_BLOCK_ROWS, EmbeddingCollection, deferred_tables, init_rows, init_table
from ctrflow.embedding.fused import FusedEmbeddingCollection
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


def test_any_row_range_of_a_table_draws_the_same_initial_rows():
    table = TableConfig("t_big", 3 * INIT_BLOCK_ROWS + 5, 2, "C1")
    whole = init_table(table, seed=7, index=3)
    for start, stop in [(0, 10), (INIT_BLOCK_ROWS - 3, INIT_BLOCK_ROWS + 4), (100, 2 * INIT_BLOCK_ROWS + 9),
                        (3 * INIT_BLOCK_ROWS, table.num_embeddings)]:
        assert torch.equal(init_rows(table, 7, 3, start, stop), whole[start:stop])


def test_deferred_tables_hold_no_memory_and_shard_like_drawn_ones():
    with deferred_tables():
        deferred = EmbeddingCollection(TABLES, seed=4)
    assert all(w.is_meta for w in deferred.weights.values())  # nothing drawn until a shard takes its rows
    drawn = EmbeddingCollection(TABLES, seed=4)
    for plan in (plan_sharding(TABLES, 1), plan_sharding(TABLES, 1, "column")):
        got = ShardedEmbeddingCollection.from_collection(deferred, plan)
        torch.testing.assert_close(got(IDS), drawn(IDS), rtol=0, atol=0)
    fused = FusedEmbeddingCollection.from_collection(deferred, optimizer="adam", lr=0.1)
    torch.testing.assert_close(fused(IDS), drawn(IDS), rtol=0, atol=0)
    assert all(w.is_meta for w in deferred.weights.values())
    for name, weight in deferred.full_weights().items():  # drawn on demand: the same numbers
        assert torch.equal(weight, drawn.full_weights()[name])


def test_one_process_sharded_collections_pool_bags_like_every_slot_looked_up_and_pooled():
    from tests.fixtures.bags import FusedSlotReference, SlotReference, bag_batches, bag_tables

    from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection

    tables = bag_tables(3)
    ids = bag_batches(tables, 6, 1)[0]
    plan = plan_sharding(tables, 1)
    for sharded, reference in (
            (ShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables, seed=4), plan),
             SlotReference(tables, seed=4)),
            (ShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables, seed=4),
                                                        plan_sharding(tables, 1, "column")),
             SlotReference(tables, seed=4)),
            (FusedShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables, seed=4), plan,
                                                             optimizer="adam", lr=0.1),
             FusedSlotReference(tables, 4, optimizer="adam", lr=0.1))):
        opts = [SparseOptimizer(m, "lazy_adam", lr=0.1) for m in (sharded, reference)
                if not isinstance(m, (FusedShardedEmbeddingCollection, FusedSlotReference))]  # fused: in backward
        for _ in range(2):
            got, expected = sharded(ids), reference(ids)
            assert got.shape == (6, len(tables), 3)
            torch.testing.assert_close(got, expected)
            for out in (got, expected):
                (out * torch.arange(out.numel()).view_as(out)).sin().sum().backward()
            for opt in opts:
                opt.step()
        assert torch.equal(got[0, 1], torch.zeros(3)) and torch.equal(got[0, 3], torch.zeros(3))  # empty bags
        for name, weight in reference.full_weights().items():
            torch.testing.assert_close(sharded.full_weights()[name], weight)


def test_sharded_collection_refuses_an_out_of_range_id_in_a_bag_naming_the_feature():
    tables = [TableConfig("t_a", 9, 3, "C1"), TableConfig("t_g", 5, 3, "G", length=3, pooling="sum")]
    sharded = ShardedEmbeddingCollection.from_collection(EmbeddingCollection(tables), plan_sharding(tables, 1))
    assert sharded(torch.tensor([[8, 4, 0, 1]])).shape == (1, 2, 3)
    with pytest.raises(UserError, match="feature G: id 5"):
        sharded(torch.tensor([[0, 1, 5, 0]]))
    with pytest.raises(UserError, match=r"\[batch, 4\]"):
        sharded(torch.tensor([[0, 1]]))
