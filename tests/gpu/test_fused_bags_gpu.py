"""The fused multi-hot kernels against their torch version and the plain collection: the bag lookup
(gather + pool in one kernel), and weights plus optimizer state after steps of SGD, row-wise Adagrad
and (lazy) Adam through the bag backward, eager and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection, bags, ops
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.embedding.pooling import slot_scales
from ctrflow.embedding.tables import tables_for
from ctrflow.contract.features import Feature, Features

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# one-id, sum and mean bags, lengths from MLPerf DLRMv2's (1..100), a tiny table with hot rows
FEATURES = Features(dense=(), sparse=(
    Feature("c", "categorical", cardinality=5000),
    Feature("s3", "multi_hot", cardinality=70000, max_length=3, pooling="sum"),
    Feature("s100", "multi_hot", cardinality=20000, max_length=100, pooling="sum"),
    Feature("m27", "multi_hot", cardinality=300, max_length=27, pooling="mean"),
    Feature("m1", "multi_hot", cardinality=11, max_length=1, pooling="mean"),
    Feature("tiny", "categorical", cardinality=3)))


def bag_ids(batch: int, gen: torch.Generator, full: bool = False) -> torch.Tensor:
    """[B, S] ids: Zipf-like (hot rows repeat within and across bags), bags filled to a random length
    then padded with 0 (some empty), or every slot filled (`full`)."""
    columns = []
    for f in FEATURES.sparse:
        u = torch.rand(batch, f.width, generator=gen, device=CUDA, dtype=torch.float64)
        ids = torch.minimum(torch.exp(u * torch.log1p(torch.tensor(float(f.cardinality)))).long() - 1,
                            torch.tensor(f.cardinality - 1))
        if f.kind == "multi_hot":
            ids = ids.clamp_min(1)
            if not full:
                lengths = torch.randint(0, f.width + 1, (batch, 1), generator=gen, device=CUDA)
                ids = torch.where(torch.arange(f.width, device=CUDA) < lengths, ids, 0)
        columns.append(ids)
    return torch.cat(columns, dim=1)


def collections(dim: int, optimizer: str, lr: float, **options):
    tables = tables_for(FEATURES.sparse, dim)
    plain = EmbeddingCollection(tables, seed=3).to(CUDA)
    fused = FusedEmbeddingCollection.from_collection(plain, optimizer=optimizer, lr=lr, device=CUDA, **options)
    params = list(plain.weights.values())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=lr),
           "rowwise_adagrad": lambda: RowwiseAdagrad(params, lr=lr),
           "adam": lambda: torch.optim.SparseAdam(params, lr=lr)}[optimizer]()
    return plain, fused, opt


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture
def torch_path(monkeypatch):
    """Run the fused ops' torch version on the GPU's tensors (the reference of the kernels)."""
    def use_torch():
        monkeypatch.setattr(ops, "uses_kernels", lambda weight: False)
    return use_torch


@pytest.mark.parametrize("dim", [128, 24])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bag_kernel_equals_the_torch_lookup(dim, out_dtype, torch_path):
    _, fused, _ = collections(dim, "sgd", 0.1, output_dtype=out_dtype)
    ids = bag_ids(4099, torch.Generator(device=CUDA).manual_seed(dim))
    layout = fused.bag_layout()
    out, scales = bags.lookup_bags(ids, layout, fused.weight, out_dtype, save_scales=True)
    assert out.dtype == out_dtype and out.shape == (4099, len(FEATURES.sparse), dim)
    expected = slot_scales(ids, layout.tables)  # each slot's weight in its bag: 1, 0 (padding) or 1/count
    assert torch.equal(scales == 0, expected == 0)
    torch.testing.assert_close(scales, expected, rtol=1e-6, atol=0)
    torch_path()
    ref, _ = bags.lookup_bags(ids, layout, fused.weight, out_dtype)
    if out_dtype == torch.float32:  # sums in another order only
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-3)
    empty = (ids[:, 4:104] == 0).all(dim=1)
    assert empty.any() and torch.equal(out[empty, 2].float(), torch.zeros_like(out[empty, 2].float()))


def test_bag_lookup_equals_the_plain_collection():
    plain, fused, _ = collections(128, "sgd", 0.1)
    ids = bag_ids(2048, torch.Generator(device=CUDA).manual_seed(1))
    torch.testing.assert_close(fused(ids), plain(ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.5), ("rowwise_adagrad", 0.05), ("adam", 0.01)])
@pytest.mark.parametrize("pre_reduce", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bag_steps_match_the_plain_optimizer(optimizer, lr, pre_reduce, grad_dtype):
    plain, fused, opt = collections(128, optimizer, lr, pre_reduce=pre_reduce, output_dtype=grad_dtype)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    for _ in range(5):
        ids = bag_ids(4096, gen)
        upstream = torch.randn(4096, len(FEATURES.sparse), 128, generator=gen, device=CUDA).to(grad_dtype)
        opt.zero_grad(set_to_none=True)
        plain(ids).backward(upstream.float())
        opt.step()
        fused(ids).backward(upstream)
    tol = 2e-4 if optimizer == "adam" else 2e-5  # Adam divides by sqrt(v): near-cancelling sums amplify rounding
    for name, weight in plain.full_weights().items():
        assert rel_err(fused.full_weights()[name], weight) < tol, name
    if optimizer != "sgd":
        state, start = fused.optimizer_state(), 0
        for t in plain.tables:
            rows = slice(start, start + t.num_embeddings)
            start += t.num_embeddings
            ref = opt.state[plain.weights[t.name]]
            mine = state["state1"][rows]
            assert rel_err(mine, ref["sum"] if optimizer == "rowwise_adagrad" else ref["exp_avg"]) < 1e-4, t.name


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_bag_kernels_equal_their_torch_version(optimizer, torch_path):
    _, kernels, _ = collections(64, optimizer, 0.05)
    _, reference, _ = collections(64, optimizer, 0.05)
    gen = torch.Generator(device=CUDA).manual_seed(9)
    steps = [(bag_ids(2048, gen), torch.randn(2048, len(FEATURES.sparse), 64, generator=gen, device=CUDA))
             for _ in range(3)]
    for ids, up in steps:
        kernels(ids).backward(up)
    torch_path()
    for ids, up in steps:
        reference(ids).backward(up)
    # the kernels sum a row's gradients in another order; Adam divides by sqrt(v), amplifying that rounding
    assert rel_err(kernels.weight, reference.weight) < (2e-4 if optimizer == "adam" else 1e-5)
    assert rel_err(kernels.optimizer_state()["state1"], reference.optimizer_state()["state1"]) < 1e-4


def test_padding_rows_never_move_and_full_bags_train_every_table():
    _, fused, _ = collections(32, "adam", 0.05)
    before = {k: v.clone() for k, v in fused.full_weights().items()}
    gen = torch.Generator(device=CUDA).manual_seed(2)
    for full in (False, True):
        ids = bag_ids(1024, gen, full=full)
        fused(ids).backward(torch.randn(1024, len(FEATURES.sparse), 32, generator=gen, device=CUDA))
    after = fused.full_weights()
    for name in ("t_s3", "t_s100", "t_m27", "t_m1"):
        assert torch.equal(after[name][0], before[name][0]), name  # padding: no gradient, no Adam step
        assert not torch.equal(after[name][1:], before[name][1:]), name


def test_captured_graph_replays_the_same_bag_steps():
    _, eager, _ = collections(128, "rowwise_adagrad", 0.05, check_ids=False)
    _, graphed, _ = collections(128, "rowwise_adagrad", 0.05, check_ids=False)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    batches = [(bag_ids(2048, gen), torch.randn(2048, len(FEATURES.sparse), 128, generator=gen, device=CUDA))
               for _ in range(4)]
    static_ids, static_up = batches[0][0].clone(), batches[0][1].clone()
    graphed(static_ids).backward(static_up)  # warm-up outside capture: compiles and the scratch buffer
    eager(static_ids).backward(static_up)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(static_ids).backward(static_up)
    for ids, up in batches:
        static_ids.copy_(ids)
        static_up.copy_(up)
        graph.replay()
        eager(ids).backward(up)
    assert rel_err(graphed.weight, eager.weight) < 1e-6
    assert rel_err(graphed.optimizer_state()["state1"], eager.optimizer_state()["state1"]) < 1e-6
