"""Two gloo ranks on CPU: the fused sharded collection (the fused kernels' torch version here) equals
the fused one-process collection fed the global batch: outputs, tables and optimizer state after
several steps, for table-, row- and data-parallel plans and a mixed one, with each fused optimizer.
The same with multi-hot bags (sum and mean, padding, empty bags) among one-hot tables, against one
fused process that looks every slot up and pools it by `pool_bags` (also as micro-batches, and with
the next step's ids routed ahead).
`tests/gpu/test_sharded_nccl.py` runs the same worker with NCCL and the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.fixtures.sharding_fused import check, compare_dlrm, worker

pytestmark = pytest.mark.integration


def test_two_ranks_match_the_fused_collection_on_the_global_batch(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results), nprocs=2, join=True)
    check(dict(results), 1e-6)


def test_replicated_gradient_counts_every_touch_of_a_large_table():
    from ctrflow.embedding.fused.replicas import replicated_grad

    rows, dim = 80_003, 2  # large enough that float bin arithmetic (histc) misplaces ids
    ids = torch.randint(0, rows, (4096, 1), generator=torch.Generator().manual_seed(1))
    grad = torch.ones(4096, 1, dim)
    acc = replicated_grad(ids, torch.zeros(1, dtype=torch.int64), grad, rows, {})
    expected = torch.bincount(ids.reshape(-1), minlength=rows).float()
    assert torch.equal(acc[rows * dim:], expected)
    assert torch.equal(acc[:rows * dim].view(rows, dim)[:, 0], expected)


def test_dlrm_step_in_chunks_equals_the_whole_batch_step():
    """One process: micro-batches (one update for all), the interaction reading the exchange
    buffers in place and the next step's ids routed ahead train DLRM as the whole batch does."""
    r = compare_dlrm(0, 1, torch.device("cpu"), dim=8)
    assert r["out"] < 1e-6 and r["weights"] < 1e-6, r
