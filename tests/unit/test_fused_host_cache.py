"""Host tables on the fused path (its torch version here): a fused collection whose large tables live in
host memory with caches of slots in its buffer trains bitwise like the same collection with every table
in the buffer (every fused optimizer, one-hot and multi-hot, a cache far smaller than the tables, the
next batch prefetched or not), evicts and writes back, reads through the cache when evaluating, loads
and writes whole tables, refuses a cache that cannot hold two batches, keeps the rows looked up most
often, and keeps a bag table's padding row in slot 0."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.fused.cache import SlotCache
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError
from tests.fixtures.bags import bag_batches, bag_tables
from tests.fixtures.host_tier import fused_pair, fused_whole, train_fused, zipf_batches

ONE_HOT = [TableConfig("t_a", 500, 16, "C1"), TableConfig("t_b", 3, 16, "C2"), TableConfig("t_c", 300, 16, "C3")]
STEPS, BATCH = 50, 16


def _batches(shape: str, steps: int = STEPS, seed: int = 0):
    if shape == "one_hot":
        return ONE_HOT, zipf_batches(ONE_HOT, steps, BATCH, seed)
    tables = bag_tables(16, scale=8)
    return tables, bag_batches(tables, BATCH, steps, seed)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("shape", ["one_hot", "multi_hot"])
@pytest.mark.parametrize("ahead", [False, True])
def test_host_tables_train_bitwise_like_tables_in_the_buffer(optimizer, shape, ahead):
    tables, batches = _batches(shape)
    device, cached = fused_pair(tables, optimizer, cache_rows=2 * BATCH * 4 + 1)  # evictions every step
    assert cached.host is not None and cached.weight.shape[0] < device.weight.shape[0]
    train_fused(device, batches)
    train_fused(cached, batches, prefetch_ahead=ahead)
    assert cached.cache_hit_rate() < 1.0
    expected, got = fused_whole(device), fused_whole(cached)
    assert sorted(got) == sorted(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_evicted_rows_go_back_to_host_memory_with_their_state_and_come_back():
    table = TableConfig("t_big", 1000, 16, "C1")
    _, cached = fused_pair([table], "rowwise_adagrad", cache_rows=8)
    cache = cached.host.caches["t_big"]
    first = torch.tensor([[1], [2], [3], [4]])
    cached(first).sum().backward()
    rows, state = cache.host[0][1:5].clone(), cache.host[1][1:5].clone()  # not written back yet
    for start in range(10, 40, 4):  # other rows push rows 1..4 out of the 8 slots
        with torch.no_grad():
            cached(torch.arange(start, start + 4).view(4, 1))
    assert (cache.slot_of[1:5] < 0).all()
    assert not torch.equal(cache.host[0][1:5], rows) and (cache.host[1][1:5] > state).all()
    updated, summed = cache.host[0][1:5].clone(), cache.host[1][1:5].clone()
    with torch.no_grad():
        cached(first)
    slots = cache.slot_of[1:5].long()
    assert torch.equal(cached.weight[slots], updated) and torch.equal(cached.row_state.state1[slots], summed)


def test_evaluation_reads_through_the_cache_and_drops_a_queued_prefetch():
    device, cached = fused_pair(ONE_HOT, "adam", cache_rows=2 * BATCH + 1)
    batches = zipf_batches(ONE_HOT, 6, BATCH)
    train_fused(device, batches[:5])
    train_fused(cached, batches[:5])
    cached.prefetch(batches[5])  # queued, then an evaluation comes first
    with torch.no_grad():
        for ids in zipf_batches(ONE_HOT, 4, BATCH, seed=1):
            assert torch.equal(cached(ids), device(ids))
    train_fused(device, batches[5:])
    train_fused(cached, batches[5:])
    expected, got = fused_whole(device), fused_whole(cached)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_whole_tables_and_state_load_into_host_tables_and_out_again():
    tables, batches = _batches("multi_hot", steps=8)
    device, cached = fused_pair(tables, "adam", cache_rows=2 * BATCH * 4 + 1)
    other, _ = fused_pair(tables, "adam", cache_rows=1, seed=9)
    train_fused(other, batches)
    keys = {"m": "state1", "v": "state2"}
    train_fused(cached, batches[:2])  # rows of other weights in the cache: a load must drop them
    for coll in (device, cached):
        coll.load_full_weights(other.full_weights())
        coll.load_table_states(keys, other.table_states(keys), steps=8)
    assert [k for k, v in fused_whole(other).items() if not torch.equal(fused_whole(cached)[k], v)] == []
    more = _batches("multi_hot", steps=6, seed=2)[1]
    train_fused(device, more)
    train_fused(cached, more)
    expected, got = fused_whole(device), fused_whole(cached)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_a_cache_smaller_than_two_batches_is_refused_with_advice():
    _, cached = fused_pair([TableConfig("t_big", 1000, 16, "C1")], "sgd", cache_rows=6)
    cached(torch.arange(0, 4).view(4, 1))
    with pytest.raises(UserError, match="cannot hold a batch's 4 ids beside the previous batch's 4.*"
                                        "--embedding-memory-gib"):
        cached(torch.arange(4, 8).view(4, 1))


def test_prefetching_two_batches_ahead_is_refused():
    _, cached = fused_pair(ONE_HOT, "sgd", cache_rows=4 * BATCH)
    batches = zipf_batches(ONE_HOT, 3, BATCH)
    cached.prefetch(batches[0])
    cached.prefetch(batches[1])
    with pytest.raises(RuntimeError, match="at most one batch ahead"):
        cached.prefetch(batches[2])


def test_a_row_looked_up_often_outstays_rows_looked_up_once():
    parts = [torch.zeros(6, 2)]
    cache = SlotCache(100, 0, 6, padding=False, parts=parts)
    for k in range(10):  # row 5 in every batch, each other row once
        cache.place(torch.tensor([5, 10 + k]), parts, train=True)
    for k in range(6):  # then 12 rows looked up once: LRU would evict row 5 by the third of these batches
        cache.place(torch.tensor([50 + 2 * k, 51 + 2 * k]), parts, train=True)
    assert int(cache.slot_of[5]) >= 0
    assert int(cache.stats[2]) == 1 + 10 + 12  # row 5 read in once


def test_a_bag_tables_padding_row_keeps_slot_0_through_batches_without_it():
    parts = [torch.zeros(8, 2)]
    cache = SlotCache(100, 0, 8, padding=True, parts=parts)
    cache.empty(parts)
    cache.place(torch.tensor([0, 1, 2]), parts, train=True)  # a batch with a short bag: padding id 0
    for start in range(10, 60, 3):  # then full bags of rows looked up once, which evict every other slot
        cache.place(torch.arange(start, start + 3), parts, train=True)
    assert int(cache.slot_of[0]) == 0 and int(cache.id_of[0]) == 0  # the kernels skip slot 0 of a bag
