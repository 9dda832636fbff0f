"""Two gloo ranks on CPU: the sharded collection equals the plain one fed the global batch.

Outputs, weights and optimizer state after several steps, for every sharding type and a mixed
plan; then whole tables and state reloaded into another sharding continue the same trajectory.
The same with multi-hot bags (sum and mean, padding, empty bags) among one-hot tables, against every
slot looked up and pooled by `pool_bags` in one process.
`tests/gpu/test_sharded_nccl.py` runs the same worker with NCCL on GPUs.
"""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from tests.fixtures.sharding_parity import check_results, worker

pytestmark = pytest.mark.integration


def test_two_ranks_match_plain_collection_for_every_sharding(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    check_results(dict(results), 1e-6)
