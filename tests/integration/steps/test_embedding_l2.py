"""The embedding L2 (`ctrflow.embedding.regularize`): the rule itself against torch's own optimizers,
and the same weights on every path (plain, fused, sharded, fused sharded) for each optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.optimizers import SparseOptimizer
from ctrflow.embedding.tables import TableConfig
from tests.fixtures.embedding_l2 import KINDS, worker

pytestmark = pytest.mark.integration

L2 = 0.05  # large against these few steps, so that a path that skips or doubles it differs clearly


def _steps(kind: str, l2: float, ids_per_step, dense_opt=None):
    """A 6-row table trained by `SparseOptimizer` (or `dense_opt(param)` on the dense gradient) on a
    fixed readout of the looked-up rows; its final weights."""
    coll = EmbeddingCollection([TableConfig("t", 6, 3, "C1")], seed=2)
    weight = coll.weights["t"]
    if dense_opt is not None:
        weight = torch.nn.Parameter(weight.detach().clone())
    opt = dense_opt(weight) if dense_opt is not None else SparseOptimizer(coll, kind, lr=0.1, l2=l2)
    readout = torch.tensor([0.5, -1.0, 2.0])
    for ids in ids_per_step:
        opt.zero_grad()
        rows = weight[ids] if dense_opt is not None else coll(ids.view(-1, 1))[:, 0]
        torch.tanh(rows @ readout).pow(2).mean().backward()
        opt.step()
    return weight.detach().clone()


EVERY_ROW = [torch.tensor([0, 1, 2, 3, 4, 5, 5, 2])] * 3


def test_sgd_with_l2_equals_torch_sgd_weight_decay_when_every_row_is_touched():
    torch.testing.assert_close(_steps("sgd", L2, EVERY_ROW),
                               _steps("sgd", 0, EVERY_ROW, lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=L2)))


def test_lazy_adam_with_l2_equals_torch_adam_weight_decay_when_every_row_is_touched():
    torch.testing.assert_close(_steps("lazy_adam", L2, EVERY_ROW),
                               _steps("lazy_adam", 0, EVERY_ROW,
                                      lambda p: torch.optim.Adam([p], lr=0.1, weight_decay=L2)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "lazy_adam", "adam"])
def test_l2_leaves_untouched_rows_alone(kind):
    some = [torch.tensor([0, 1, 1])] * 3
    start = EmbeddingCollection([TableConfig("t", 6, 3, "C1")], seed=2).weights["t"].detach()
    with_l2, without = _steps(kind, L2, some), _steps(kind, 0.0, some)
    assert torch.equal(with_l2[2:], start[2:])  # never looked up: no penalty, no pass over the table
    assert not torch.allclose(with_l2[:2], without[:2])  # the touched rows were penalized


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_bags_with_l2_match_plain(kind):
    from tests.fixtures.bags import bag_batches, bag_tables

    tables = bag_tables(8)  # one-id tables and sum / mean bags (padding, empty bags)
    plain = EmbeddingCollection(tables, seed=1)
    fused = FusedEmbeddingCollection.from_collection(plain, optimizer=KINDS[kind], lr=0.05, l2=L2)
    opt = SparseOptimizer(plain, kind, lr=0.05, l2=L2)
    gen = torch.Generator().manual_seed(0)
    for ids in bag_batches(tables, 64, 4):
        upstream = torch.randn(64, len(tables), 8, generator=gen)
        opt.zero_grad()
        plain(ids).backward(upstream)
        opt.step()
        fused(ids).backward(upstream)
    atol = 1e-4 if kind == "lazy_adam" else 1e-6
    for name, weight in plain.full_weights().items():
        torch.testing.assert_close(fused.full_weights()[name], weight, rtol=1e-5, atol=atol)
    # a bag table's padding row starts at zero and stays there under the L2, on both paths
    assert not fused.full_weights()["t_g"][0].any() and not plain.full_weights()["t_g"][0].any()


def test_plain_fused_and_sharded_paths_give_the_same_weights_with_l2(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, str(tmp_path / "store"), results, L2), nprocs=2, join=True)
    results = dict(results)
    assert set(results) == set(KINDS)
    for kind, r in results.items():
        tolerance = 1e-5 if kind == "lazy_adam" else 1e-6  # Adam divides by sqrt(v) (tiny eps here)
        assert r["fused"] < tolerance and r["sharded"] < tolerance and r["fused_sharded"] < tolerance, (kind, r)
        assert r["l2_effect"] > 1e-3, (kind, r)  # the L2 changed the weights, so the paths agree on it
