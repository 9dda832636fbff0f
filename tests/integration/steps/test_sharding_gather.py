"""Two gloo ranks: a whole table gathered for a checkpoint (`gathered_on_main`) is the same whole
table every rank gets from the all-gather, for table-, row- and column-wise shards, per-row state and
bf16 shards, while the other rank gets only a placeholder."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctrflow.embedding import gather
from ctrflow.embedding.plan import plan_sharding
from ctrflow.embedding.sharded import gather_whole, gathered_on_main
from ctrflow.embedding.tables import TableConfig

pytestmark = pytest.mark.integration

TABLES = [TableConfig("t_a", 11, 4, "C1"), TableConfig("t_b", 6, 4, "C2")]


def shard_of(whole: torch.Tensor, shard, per_row: bool) -> torch.Tensor:
    rows = whole[shard.rows[0]:shard.rows[1]]
    return rows if per_row else rows[:, shard.cols[0]:shard.cols[1]].contiguous()


def worker(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    gather.SEND_BYTES = 32  # a shard sent to the first rank in messages of 2 rows (8 per-row values)
    checked = 0
    for sharding in ("table", "row", "column"):
        plan = plan_sharding(TABLES, 2, sharding)
        for t in TABLES:
            tp = plan.tables[t.name]
            for per_row, dtype in ((False, torch.float32), (False, torch.bfloat16), (True, torch.float32)):
                whole = torch.arange(t.num_embeddings * (1 if per_row else t.embedding_dim), dtype=torch.float32)
                whole = whole.view(t.num_embeddings, -1).squeeze(1) if per_row else whole.view(t.num_embeddings, -1)
                whole = whole.to(dtype)
                mine = next((s for s in tp.shards if s.rank == rank), None)
                local = None if mine is None else shard_of(whole, mine, per_row)
                everywhere = gather_whole(t, tp, local, None, torch.device("cpu"), per_row)
                with gathered_on_main():
                    on_main = gather_whole(t, tp, local, None, torch.device("cpu"), per_row)
                assert torch.equal(everywhere, whole.float()), (sharding, t.name, per_row, dtype)
                if rank == 0:
                    assert torch.equal(on_main, whole.float()), (sharding, t.name, per_row, dtype)
                else:
                    assert on_main.shape == whole.shape and on_main.stride() == (0,) * whole.dim()
                checked += 1
    results[rank] = checked
    dist.destroy_process_group()


def test_gathered_on_main_assembles_what_the_all_gather_does(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    assert results[0] == results[1] == 18
