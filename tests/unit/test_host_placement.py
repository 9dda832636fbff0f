"""The placement planner: tables within a device memory budget, the rest in host memory with a cache."""

from __future__ import annotations

import json

import pytest

from ctrflow.embedding.optimizers import state_bytes
from ctrflow.embedding.placement import HostTier, place_in_budget, placement_summary
from ctrflow.embedding.plan import ShardingPlan, plan_sharding
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError

GIB = 2**30
# a DLRMv2-like mix at dim 128: four 40M-row tables (20 GiB each in fp32), a 3M-row one, small ones
TABLES = [TableConfig("t_big1", 40_000_000, 128, "C1"), TableConfig("t_mid", 3_000_000, 128, "C2"),
          TableConfig("t_big2", 40_000_000, 128, "C3", length=100, pooling="sum"),
          TableConfig("t_small", 10_000, 128, "C4"), TableConfig("t_tiny", 4, 128, "C5")]


def adagrad(t: TableConfig) -> int:
    return state_bytes(t, "adagrad")


def _place(plan, budget_gib, batch=4096, device_only=lambda t: False):
    return place_in_budget(plan, TABLES, HostTier(int(budget_gib * GIB), batch, device_only), adagrad)


def test_tables_that_fit_the_budget_all_stay_on_the_device():
    plan = _place(plan_sharding(TABLES, 1), 64)
    assert placement_summary(plan) == "device"
    assert all(s.placement == "device" for tp in plan.tables.values() for s in tp.shards)


def test_tables_beyond_the_budget_go_to_host_memory_with_caches_filling_the_rest():
    plan = _place(plan_sharding(TABLES, 1), 8)
    where = {name: tp.shards[0] for name, tp in plan.tables.items()}
    assert [n for n, s in where.items() if s.placement == "host"] == ["t_big1", "t_big2"]
    used = plan.bytes_per_rank(TABLES, adagrad)[0]
    assert 0.99 * 8 * GIB < used <= 8 * GIB  # the caches take what the whole tables left
    # caches in proportion to the ids a sample looks up: t_big2's bags of 100 ids get 100 times t_big1's
    assert where["t_big2"].cache_rows > 2 * 4096 * 100
    assert where["t_big2"].cache_rows == pytest.approx(100 * where["t_big1"].cache_rows, rel=1e-4)
    assert placement_summary(plan) == (f"device 3, host 2 (caches of "
                                       f"{where['t_big1'].cache_rows + where['t_big2'].cache_rows:,} rows)")


def test_the_tables_with_most_lookups_per_byte_stay_whole_first():
    # room for t_mid (1.5 GiB, one id a sample) and caches, not for t_big2 (100 ids a sample): t_big2's 100 ids
    # per sample do not make 20 GiB cheaper per lookup than t_mid's 1.5 GiB for one
    plan = _place(plan_sharding(TABLES, 1), 3)
    assert plan.tables["t_mid"].shards[0].placement == "device"
    assert plan.tables["t_small"].shards[0].placement == "device"


def test_tables_that_must_stay_on_the_device_do_even_when_large():
    plan = _place(plan_sharding(TABLES, 1), 24, device_only=lambda t: t.name == "t_big2")
    assert plan.tables["t_big2"].shards[0].placement == "device"
    assert plan.tables["t_big1"].shards[0].placement == "host"


def test_row_shards_on_two_ranks_are_placed_per_rank_and_replicas_stay_on_the_device():
    plan = _place(plan_sharding(TABLES, 2, "auto"), 6)
    assert plan.tables["t_tiny"].sharding == "data"
    assert all(s.placement == "device" for s in plan.tables["t_tiny"].shards)
    big = plan.tables["t_big1"]
    assert big.sharding == "row" and {s.placement for s in big.shards} == {"host"}
    assert all(b <= 6 * GIB for b in plan.bytes_per_rank(TABLES, adagrad))


def test_a_budget_below_the_smallest_caches_is_refused_with_advice():
    with pytest.raises(UserError, match="rank 0 keeps t_small, t_big2, t_mid, t_big1 in host memory.*--embedding-mem"):
        _place(plan_sharding(TABLES, 1), 0.5)
    with pytest.raises(UserError, match="--embedding-memory-gib must be positive .* got -3"):
        _place(plan_sharding(TABLES, 1), -3)


def test_placements_round_trip_through_plan_files_and_describe_shows_them():
    plan = _place(plan_sharding(TABLES, 2, "auto"), 6)
    again = ShardingPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    text = plan.describe(TABLES, adagrad)
    assert "host, cache" in text and "device" in text


def test_tables_that_must_stay_on_the_device_but_exceed_the_budget_are_refused():
    with pytest.raises(UserError, match="rank 0 needs .* MiB for the tables that stay on the device"):
        _place(plan_sharding(TABLES, 1), 8, device_only=lambda t: t.name.startswith("t_big"))
