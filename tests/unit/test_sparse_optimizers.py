"""Sparse per-table optimizers against torch's dense optimizers and their formulas."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.optimizers import SparseOptimizer, choose_kind, sparse_parameters
from ctrflow.embedding.tables import TableConfig

TABLE = TableConfig("t_a", 6, 3, "C1")


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = EmbeddingCollection([TABLE], seed=1)
        self.readout = torch.tensor([[0.5], [-1.0], [2.0]])

    def forward(self, ids):
        return torch.tanh(self.embeddings(ids)[:, 0] @ self.readout).pow(2).mean()


BATCHES = [torch.tensor([[0], [2], [2], [5]]), torch.tensor([[1], [2]]), torch.tensor([[5], [5], [0]])]


def _run(kind, batches=BATCHES, **kw):
    model = Lookup()
    opt = SparseOptimizer(model, kind, lr=0.05, **kw)
    for ids in batches:
        opt.zero_grad()
        model(ids).backward()
        opt.step()
    return model, opt


def _run_dense(make_opt, batches=BATCHES):
    model = Lookup()
    weight = model.embeddings.weights["t_a"]
    opt = make_opt([weight])
    for ids in batches:
        opt.zero_grad()
        model(ids).backward()
        weight.grad = weight.grad.to_dense()
        opt.step()
    return weight.detach()


def test_adam_equals_torch_adam_on_the_dense_gradient():
    model, _ = _run("adam")
    expected = _run_dense(lambda p: torch.optim.Adam(p, lr=0.05))
    torch.testing.assert_close(model.embeddings.weights["t_a"].detach(), expected)


def test_sgd_sums_duplicate_ids_like_dense_sgd():
    model, _ = _run("sgd")
    expected = _run_dense(lambda p: torch.optim.SGD(p, lr=0.05))
    torch.testing.assert_close(model.embeddings.weights["t_a"].detach(), expected)


def test_lazy_adam_moves_only_touched_rows_and_equals_adam_when_all_are():
    start = Lookup().embeddings.weights["t_a"].detach()
    model, opt = _run("lazy_adam")
    moved = (model.embeddings.weights["t_a"].detach() != start).any(1)
    assert moved.tolist() == [True, True, True, False, False, True]  # row 3, 4 never in a batch
    every_row = [torch.arange(6).view(6, 1)] * 3
    lazy, _ = _run("lazy_adam", every_row)
    torch.testing.assert_close(lazy.embeddings.weights["t_a"].detach(),
                               _run_dense(lambda p: torch.optim.Adam(p, lr=0.05), every_row))


def test_rowwise_adagrad_scales_each_row_by_its_mean_squared_gradient():
    model = Lookup()
    weight = model.embeddings.weights["t_a"]
    before = weight.detach().clone()
    opt = SparseOptimizer(model, "adagrad", lr=0.05, eps=1e-8)
    model(BATCHES[0]).backward()
    grad = weight.grad.to_dense()
    opt.step()
    acc = grad.pow(2).mean(1, keepdim=True)
    expected = torch.where(acc > 0, before - 0.05 * grad / (acc.sqrt() + 1e-8), before)
    torch.testing.assert_close(weight.detach(), expected)


def test_resumed_optimizer_continues_the_same_trajectory():
    full, _ = _run("lazy_adam")
    model, opt = _run("lazy_adam", BATCHES[:2])
    saved_state, saved_weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    again = Lookup()
    again.load_state_dict(saved_weights)
    opt2 = SparseOptimizer(again, "lazy_adam", lr=0.05)
    opt2.load_state_dict(saved_state)
    opt2.zero_grad()
    again(BATCHES[2]).backward()
    opt2.step()
    torch.testing.assert_close(again.embeddings.weights["t_a"].detach(), full.embeddings.weights["t_a"].detach())


def test_auto_puts_lazy_adam_on_large_tables_and_adam_on_small():
    big, small = TableConfig("t_big", 200_000, 4, "C1"), TableConfig("t_small", 10, 4, "C2")
    assert choose_kind(big) == "lazy_adam" and choose_kind(small) == "adam"
    assert choose_kind(small, large_table_rows=5) == "lazy_adam"
    with pytest.raises(ValueError, match="unknown sparse optimizer"):
        choose_kind(small, "rmsprop")


def test_sparse_parameters_are_exactly_the_embedding_weights():
    model = Lookup()
    assert sparse_parameters(model) == {model.embeddings.weights["t_a"]}
