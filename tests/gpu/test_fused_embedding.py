"""The fused Triton embedding path against the plain one: lookups, and weights plus optimizer state
after several steps of SGD, row-wise Adagrad and (lazy) Adam, eager and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.embedding.tables import tables_for
from ctrflow.contract.features import Features

pytestmark = pytest.mark.gpu
SIZES = [5000, 3, 70000, 10, 1, 257]
CUDA = torch.device("cuda")


def skewed_ids(batch: int, gen: torch.Generator) -> torch.Tensor:
    """[B, F] ids with heavy repeats (Zipf-like), so hot rows get many gradient rows per batch."""
    n = torch.tensor(SIZES, dtype=torch.float64, device=CUDA)
    u = torch.rand(batch, len(SIZES), generator=gen, device=CUDA, dtype=torch.float64)
    return torch.minimum(torch.exp(u * torch.log1p(n)).long() - 1, n.long() - 1)


def plain_and_fused(dim: int, optimizer: str, lr: float, **options):
    tables = tables_for(Features.categorical(dict(zip([f"C{i + 1}" for i in range(len(SIZES))], SIZES))).sparse, dim)
    plain = EmbeddingCollection(tables, seed=3).to(CUDA)
    fused = FusedEmbeddingCollection.from_collection(plain, optimizer=optimizer, lr=lr, device=CUDA, **options)
    params = list(plain.weights.values())
    opt = {"sgd": lambda: torch.optim.SGD(params, lr=lr),
           "rowwise_adagrad": lambda: RowwiseAdagrad(params, lr=lr),
           "adam": lambda: torch.optim.SparseAdam(params, lr=lr)}[optimizer]()
    return plain, fused, opt


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dim", [128, 24])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_lookup_equals_plain_forward(dim, out_dtype):
    plain, fused, _ = plain_and_fused(dim, "sgd", 0.1, output_dtype=out_dtype)
    ids = skewed_ids(4099, torch.Generator(device=CUDA).manual_seed(dim))
    out = fused(ids)
    assert out.dtype == out_dtype and out.shape == (4099, len(SIZES), dim)
    assert torch.equal(out, plain(ids).to(out_dtype))


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.5), ("rowwise_adagrad", 0.05), ("adam", 0.01)])
@pytest.mark.parametrize("pre_reduce", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_steps_match_plain_optimizer(optimizer, lr, pre_reduce, grad_dtype):
    plain, fused, opt = plain_and_fused(128, optimizer, lr, pre_reduce=pre_reduce, output_dtype=grad_dtype)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    for _ in range(5):
        ids = skewed_ids(8192, gen)
        upstream = torch.randn(8192, len(SIZES), 128, generator=gen, device=CUDA).to(grad_dtype)
        opt.zero_grad(set_to_none=True)
        plain(ids).backward(upstream.float())
        opt.step()
        fused(ids).backward(upstream)
    # Adam divides by sqrt(v): elements whose summed grad nearly cancels amplify rounding
    tol = 2e-4 if optimizer == "adam" else 2e-5
    for name, weight in plain.full_weights().items():
        assert rel_err(fused.full_weights()[name], weight) < tol, name
    assert_state_matches(plain, fused, opt, optimizer)


def assert_state_matches(plain, fused, opt, optimizer):
    if optimizer == "sgd":
        return
    state = fused.optimizer_state()
    start = 0
    for t in plain.tables:
        rows = slice(start, start + t.num_embeddings)
        start += t.num_embeddings
        ref = opt.state[plain.weights[t.name]]
        if optimizer == "rowwise_adagrad":
            assert rel_err(state["state1"][rows], ref["sum"]) < 1e-4, t.name
        else:
            assert rel_err(state["state1"][rows], ref["exp_avg"]) < 1e-4, t.name
            assert rel_err(state["state2"][rows], ref["exp_avg_sq"]) < 1e-4, t.name
    if optimizer == "adam":
        assert float(state["hyper"][1]) == 5.0


@pytest.mark.parametrize("dim,storage,optimizer,lr", [
    (64, torch.bfloat16, "sgd", 0.5), (128, torch.bfloat16, "sgd", 0.5), (64, torch.float32, "sgd", 0.5),
    (128, torch.bfloat16, "rowwise_adagrad", 0.05), (128, torch.bfloat16, "adam", 0.01),
    (24, torch.float16, "rowwise_adagrad", 0.05)])
def test_low_precision_storage_tracks_fp32_training(dim, storage, optimizer, lr):
    # every touched row must move (a lost update leaves a row ~100% off, not the storage's rounding)
    plain, fused, opt = plain_and_fused(dim, optimizer, lr, storage_dtype=storage)
    gen = torch.Generator(device=CUDA).manual_seed(11)
    for _ in range(3):
        ids = skewed_ids(4096, gen)
        upstream = torch.randn(4096, len(SIZES), dim, generator=gen, device=CUDA)
        opt.zero_grad(set_to_none=True)
        plain(ids).backward(upstream)
        opt.step()
        fused(ids).backward(upstream)
    for name, weight in plain.full_weights().items():
        got = fused.full_weights()[name]
        assert got.dtype == storage
        assert rel_err(got, weight) < 1e-2, name
        row_err = (got.double() - weight.double()).norm(dim=1) / weight.double().norm(dim=1).clamp(min=1e-30)
        assert float(row_err.max()) < 0.05, name
    if optimizer == "rowwise_adagrad":
        assert rel_err(fused.optimizer_state()["state1"], torch.cat(
            [opt.state[p]["sum"] for p in plain.weights.values()])) < 1e-3


def test_captured_graph_replays_the_same_steps():
    eager_plain, eager, _ = plain_and_fused(128, "rowwise_adagrad", 0.05, check_ids=False)
    graphed = FusedEmbeddingCollection.from_collection(eager_plain, optimizer="rowwise_adagrad", lr=0.05,
                                                       device=CUDA, check_ids=False)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    batches = [(skewed_ids(2048, gen), torch.randn(2048, len(SIZES), 128, generator=gen, device=CUDA))
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
