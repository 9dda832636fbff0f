"""The sharding planner, plan files and id checks (single process)."""

from __future__ import annotations

import json

import pytest
import torch

from ctrflow.embedding.plan import ShardingPlan, plan_sharding, read_plan_overrides
from ctrflow.embedding.tables import TableConfig, check_ids, tables_for
from ctrflow.errors import UserError
from ctrflow.contract.features import Features

# MLPerf Criteo-1TB DLRM table sizes (40M-capped)
MLPERF_ROWS = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
               11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]
MLPERF = tables_for(Features.categorical(dict(zip([f"C{i + 1}" for i in range(26)], MLPERF_ROWS))).sparse, 128)


def test_auto_plan_balances_mlperf_tables_over_four_ranks():
    plan = plan_sharding(MLPERF, 4)
    per_rank = plan.bytes_per_rank(MLPERF)
    assert max(per_rank) < 1.1 * sum(per_rank) / 4 + 0.5 * 2**30  # within ~10 % of an even split
    kinds = {t.num_embeddings: plan.tables[t.name].sharding for t in MLPERF}
    assert kinds[39884406] == "row" and kinds[3] == "data" and kinds[403346] == "table"
    replicated = sum(t.bytes for t in MLPERF if kinds[t.num_embeddings] == "data")
    assert sum(per_rank) == sum(t.bytes for t in MLPERF) + 3 * replicated


def test_every_shard_of_every_type_covers_its_table_once():
    tables = [TableConfig("t_x", 10, 6, "C1"), TableConfig("t_y", 3, 6, "C2")]
    for kind in ("table", "row", "column", "data"):
        plan = plan_sharding(tables, 4, kind)
        for t in tables:
            cells = torch.zeros(t.num_embeddings, t.embedding_dim)
            for s in plan.tables[t.name].shards:
                cells[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] += 1
            assert (cells == (4 if kind == "data" else 1)).all(), (kind, t.name)


def test_one_rank_keeps_every_table_whole():
    plan = plan_sharding(MLPERF[:5], 1)
    assert all(tp.sharding == "table" and tp.shards[0].rank == 0 for tp in plan.tables.values())


def test_plan_file_round_trip_and_per_table_override(tmp_path):
    tables = MLPERF[:6]
    plan = plan_sharding(tables, 2)
    plan.save(tmp_path / "plan.json")
    again = plan_sharding(tables, 2, overrides=read_plan_overrides(tmp_path / "plan.json"))
    assert again == plan
    partial = {"tables": {"t_C2": "column", "t_C3": {"sharding": "table", "rank": 1}}}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    mixed = plan_sharding(tables, 2, overrides=read_plan_overrides(tmp_path / "partial.json"))
    assert mixed.tables["t_C2"].sharding == "column"
    assert [s.rank for s in mixed.tables["t_C3"].shards] == [1]
    assert ShardingPlan.from_json(json.loads(json.dumps(mixed.to_json()))) == mixed


def test_bad_plan_files_are_refused_with_the_table_named(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"tables": {"t_nope": "row"}}))
    with pytest.raises(UserError, match="t_nope"):
        plan_sharding(MLPERF[:3], 2, overrides=read_plan_overrides(path))
    path.write_text(json.dumps({"tables": {"t_C1": "diagonal"}}))
    with pytest.raises(UserError, match="t_C1"):
        read_plan_overrides(path)
    path.write_text(json.dumps({"tables": {"t_C1": {"sharding": "table", "rank": 5}}}))
    with pytest.raises(UserError, match="rank 5"):
        plan_sharding(MLPERF[:3], 2, overrides=read_plan_overrides(path))


def test_plan_that_cannot_fit_names_the_rank_and_sizes():
    with pytest.raises(UserError, match="does not fit: rank"):
        plan_sharding(MLPERF, 2, memory_budget=20 * 2**30)
    plan_sharding(MLPERF, 2, memory_budget=48 * 2**30)  # fits row-wise


def test_auto_splits_by_rows_a_table_no_single_rank_can_hold():
    tables = [TableConfig(f"t_{i}", 25, 1, f"C{i}") for i in range(20)]  # 100 bytes each
    plan = plan_sharding(tables, 2, memory_budget=[1460, 560], replicate_bytes=0)
    kinds = [tp.sharding for tp in plan.tables.values()]
    assert kinds.count("table") == 19 and kinds.count("row") == 1  # 14 + 5 whole, the last one split
    assert plan.bytes_per_rank(tables) == [1452, 548]  # 13 + 12 rows of the split one


def test_global_column_sharding_keeps_narrow_tables_whole():
    tables = [TableConfig("t_wide", 9, 8, "C1"), TableConfig("t_one", 9, 1, "C1")]
    plan = plan_sharding(tables, 2, "column")
    assert plan.tables["t_wide"].sharding == "column" and plan.tables["t_one"].sharding == "table"


def test_describe_lists_every_table_and_memory_per_rank():
    text = plan_sharding(MLPERF, 2).describe(MLPERF)
    assert all(t.name in text for t in MLPERF) and "memory per rank" in text


def test_out_of_range_id_names_the_feature():
    tables = [TableConfig("t_C1", 5, 2, "C1"), TableConfig("t_C2", 3, 2, "C2")]
    check_ids(torch.tensor([[4, 2], [0, 0]]), tables)
    with pytest.raises(UserError, match="feature C2: id 3 in batch row 1"):
        check_ids(torch.tensor([[4, 2], [0, 3]]), tables)
    with pytest.raises(UserError, match="feature C1: id -1"):
        check_ids(torch.tensor([[-1, 0]]), tables)


def test_fused_auto_plan_balances_lookups_counting_a_bags_ids():
    """A bag of 8 ids is 8 rows to read and update a sample: the table-wise planner weighs it so."""
    same = dict(num_embeddings=1000, embedding_dim=8)
    tables = [TableConfig("t_bag", feature="G", length=8, pooling="sum", **same),
              *[TableConfig(f"t_{c}", feature=c, **same) for c in ("C1", "C2", "C3")]]
    plan = plan_sharding(tables, 2, replicate_bytes=0, large="table")
    ranks = {t.name: plan.tables[t.name].shards[0].rank for t in tables}
    assert ranks == {"t_bag": 0, "t_C1": 1, "t_C2": 1, "t_C3": 1}
    one_hot = plan_sharding([TableConfig("t_bag", feature="G", **same), *tables[1:]], 2, replicate_bytes=0,
                            large="table")
    assert [s.shards[0].rank for s in one_hot.tables.values()] == [0, 1, 0, 1]


def test_fused_auto_plan_gives_the_longest_bag_a_rank_of_its_own():
    """MLPerf DLRMv2's large tables on 2 ranks: the 100-id bag alone (100 ids a sample) against the other
    seven (70), not the 63 / 107 that placing them in memory order gave: the busier rank sets the step."""
    hot = {"C1": 3, "C10": 7, "C11": 3, "C12": 8, "C20": 12, "C21": 100, "C22": 27, "C23": 10}
    rows = {"C11": 3_067_956, "C12": 405_282, "C23": 590_152}
    tables = [TableConfig(f"t_{c}", rows.get(c, 40_000_000), 128, c, length=n, pooling="sum")
              for c, n in hot.items()]
    plan = plan_sharding(tables, 2, large="table")
    ids = [0, 0]
    for t in tables:
        assert plan.tables[t.name].sharding == "table"
        ids[plan.tables[t.name].shards[0].rank] += t.length
    assert sorted(ids) == [70, 100]


def test_fused_auto_plan_evens_out_the_ranks_lookups_with_the_small_tables():
    """MLPerf DLRMv2 on 2 ranks: C21's bag alone is 2 x 100 ids of the step's samples against the other
    large tables' 2 x 70, each rank also looking up its own samples in the replicated tables (44 ids).
    Small tables moved whole onto the lighter rank even the two out (214 each); a table the user
    placed stays where it is, and a plan of one-hot tables that is already even keeps its replicas."""
    rows = [40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
            2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36]
    hot = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
    tables = [TableConfig(f"t_C{i + 1}", n, 128, f"C{i + 1}", length=h, pooling="sum")
              for i, (n, h) in enumerate(zip(rows, hot))]

    def ids_per_rank(plan):
        ids = [0, 0]
        for t in tables:
            tp = plan.tables[t.name]
            for s in tp.shards:
                ids[s.rank] += t.length * (1 if tp.sharding == "data" else 2)
        return ids

    plan = plan_sharding(tables, 2, large="table", replicate_bytes=32 << 20)
    assert ids_per_rank(plan) == [214, 214]
    c21 = plan.tables["t_C21"].shards[0].rank
    moved = {t.name for t in tables if t.num_embeddings < 65_536 and plan.tables[t.name].sharding == "table"}
    assert moved and all(plan.tables[n].shards[0].rank != c21 for n in moved)
    kept = plan_sharding(tables, 2, large="table", replicate_bytes=32 << 20, overrides={"t_C15": "data"})
    assert kept.tables["t_C15"].sharding == "data"
    one_hot = [TableConfig(t.name, t.num_embeddings, 128, t.feature) for t in tables]
    even = plan_sharding(one_hot, 2, large="table", replicate_bytes=32 << 20)
    assert all(even.tables[t.name].sharding == "data" for t in one_hot if t.num_embeddings < 65_536)
