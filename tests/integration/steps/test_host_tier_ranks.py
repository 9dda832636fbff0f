"""Two gloo ranks on CPU: shards in host memory with small device caches train bitwise like the same
plan all on the device (50 steps; table-, row- and column-wise; one-hot tables and multi-hot bags)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from tests.fixtures.host_tier_ranks import CASES, worker

pytestmark = pytest.mark.integration


def test_two_ranks_with_shards_in_host_memory_match_all_on_the_device(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    assert sorted(results) == sorted(f"{s}/{n}" for s in CASES for n in ("one_hot", "bags"))
    for case, (hosted, differing) in results.items():
        assert hosted > 0, case
        assert differing == [], case
