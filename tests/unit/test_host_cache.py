"""Tables in host memory with a device cache: a cached collection trains bitwise like one on the
device (every sparse optimizer, one-hot and multi-hot, a cache far smaller than the table), evicts
and writes back, reads through the cache when evaluating, and refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.optimizers import SparseOptimizer
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError
from tests.fixtures.bags import bag_batches, bag_tables
from tests.fixtures.host_tier import cached_collection, train, whole, zipf_batches

ONE_HOT = [TableConfig("t_a", 500, 4, "C1"), TableConfig("t_b", 3, 4, "C2"), TableConfig("t_c", 300, 4, "C3")]
STEPS, BATCH = 50, 16


def _zipf_batches(tables, steps=STEPS, seed=0):
    return zipf_batches(tables, steps, BATCH, seed)


def _cached(tables, cache_rows, seed=3):
    return cached_collection(tables, cache_rows, seed=seed)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy_adam"])
@pytest.mark.parametrize("shape", ["one_hot", "multi_hot"])
def test_a_cached_collection_trains_bitwise_like_one_on_the_device(kind, shape):
    tables = ONE_HOT if shape == "one_hot" else bag_tables(4, scale=8)
    batches = _zipf_batches(tables) if shape == "one_hot" else bag_batches(tables, BATCH, STEPS)
    plain = EmbeddingCollection(tables, seed=3)
    cached = _cached(tables, cache_rows=4 * BATCH * 4)  # a sixth of t_a's rows: evictions every step
    expected, got = whole(plain, train(plain, batches, kind)), whole(cached, train(cached, batches, kind))
    assert cached.cache_hit_rate() < 1.0
    assert sorted(got) == sorted(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_prefetching_the_next_batch_during_a_step_changes_no_number():
    batches = _zipf_batches(ONE_HOT)
    inline, ahead = _cached(ONE_HOT, 2 * BATCH), _cached(ONE_HOT, 2 * BATCH)
    train(inline, batches, "adagrad")
    train(ahead, batches, "adagrad", prefetch_ahead=True)
    for t in ONE_HOT:
        assert torch.equal(ahead.full_table(t.name), inline.full_table(t.name))


def test_evicted_rows_are_written_back_and_read_again_with_their_state():
    table = TableConfig("t_big", 1000, 4, "C1")
    cached = _cached([table], cache_rows=8)
    opt = SparseOptimizer(cached, "adagrad", lr=0.1)
    first = torch.tensor([[1], [2], [3], [4]])
    cached(first).sum().backward()
    opt.step()
    after_step = cached.full_table("t_big")[1:5].clone()
    state = opt.whole_state("t_big", "sum")[1:5].clone()
    assert (state > 0).all()
    for start in range(10, 40, 4):  # other rows push rows 1..4 out of the 8 slots
        cached(torch.arange(start, start + 4).view(4, 1))
    cache = cached.caches["t_big"]
    assert (cache.slot_of[1:5] < 0).all()  # evicted
    assert torch.equal(cache.store[1:5], after_step) and torch.equal(cache.host_state["sum"][1:5], state)
    cached(first)  # read back into the cache
    slots = cache.slot_of[1:5].long()
    assert torch.equal(cache.weight.detach()[slots], after_step) and torch.equal(cache.state["sum"][slots], state)


def test_evaluation_reads_through_the_cache_without_dirtying_it():
    batches = _zipf_batches(ONE_HOT, steps=5)
    plain, cached = EmbeddingCollection(ONE_HOT, seed=3), _cached(ONE_HOT, 2 * BATCH)
    train(plain, batches, "lazy_adam")
    train(cached, batches, "lazy_adam")
    for t in ONE_HOT:
        cached.full_table(t.name)  # written back: nothing dirty
    with torch.no_grad():
        for ids in _zipf_batches(ONE_HOT, steps=6, seed=1):
            assert torch.equal(cached(ids), plain(ids))
    assert not any(bool(c.dirty.any()) for c in cached.caches.values())


def test_a_cache_smaller_than_two_batches_of_rows_is_refused_with_advice():
    cached = _cached([TableConfig("t_big", 1000, 4, "C1")], cache_rows=6)
    cached(torch.arange(0, 4).view(4, 1))
    with pytest.raises(UserError, match="cannot hold a batch's 4 distinct rows.*--embedding-memory-gib"):
        cached(torch.arange(4, 8).view(4, 1))
    with pytest.raises(UserError, match="cannot hold a batch's 9 distinct rows"):
        cached(torch.arange(20, 29).view(9, 1))


def test_dense_adam_on_a_table_in_host_memory_is_refused():
    cached = _cached([TableConfig("t_big", 1000, 4, "C1")], cache_rows=64)
    with pytest.raises(UserError, match="t_big: dense adam.*lazy_adam"):
        SparseOptimizer(cached, "adam")


def test_whole_tables_and_state_load_into_a_cached_collection_and_out_again():
    batches = _zipf_batches(ONE_HOT, steps=8)
    plain = EmbeddingCollection(ONE_HOT, seed=3)
    plain_opt = train(plain, batches, "adagrad")
    cached = _cached(ONE_HOT, 2 * BATCH, seed=9)
    cached_opt = SparseOptimizer(cached, "adagrad", lr=0.05, l2=1e-3)
    cached(batches[0])  # rows of the old weights in the cache: a load must drop them
    cached.load_full_weights(plain.full_weights())
    cached_opt.load_state_dict(plain_opt.state_dict())
    more = _zipf_batches(ONE_HOT, steps=6, seed=2)
    expected, got = (whole(coll, train(coll, more, "adagrad", opt=opt))
                     for coll, opt in ((plain, plain_opt), (cached, cached_opt)))
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
