"""`FusedCrossNet` (Triton products with the cross layer's elementwise work in their epilogues)
against the plain cross layers under bf16 autocast: values, gradients, Adam's state after a few
DCNv2 steps, and the compiled head replayed in a CUDA graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ctrflow.embedding.fused.cross import FusedCrossNet
from ctrflow.models import build_model
from ctrflow.models.layers import LowRankCrossNet
from ctrflow.train.graphs import compile_dense

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _run(cross: nn.Module, x0: torch.Tensor, grad: torch.Tensor, autocast: bool = True) -> list[torch.Tensor]:
    cross.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        y = cross(x)
    y.backward(grad.to(y.dtype))
    return [y, x.grad, *(p.grad for p in cross.parameters())]


# widths: 3456 = MLPerf's 27 x 128 (128-wide tiles), 864 = 27 x 32 (32-wide tiles);
# 1000 rows: a partial last row tile
@pytest.mark.parametrize("rows,width,rank,layers", [(1000, 3456, 512, 3), (4096, 864, 512, 2), (2048, 384, 64, 1)])
def test_fused_cross_matches_plain_values_and_gradients(rows, width, rank, layers):
    torch.manual_seed(0)
    plain = LowRankCrossNet(width, layers, rank).to(CUDA)
    for up in plain.up:
        nn.init.normal_(up.bias, std=0.1)
    fused = FusedCrossNet.from_plain(copy.deepcopy(plain))
    x0 = torch.randn(rows, width, device=CUDA).bfloat16()  # as the model's concatenation makes it
    assert not fused.fusable(x0)  # autocast off here
    grad = torch.randn(rows, width, device=CUDA)
    exact = _run(copy.deepcopy(plain).double(), x0.double(), grad.double(), autocast=False)
    want, got = _run(plain, x0, grad), _run(fused, x0, grad)
    names = ["y", "dx0", *(n for n, _ in plain.named_parameters())]
    for name, e, w, g in zip(names, exact, want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        # bf16 rounding in both paths: the fused one no further from the fp64 truth than plain bf16
        assert rel_err(g, e) < 1.5 * rel_err(w, e) + 2e-3, (name, rel_err(g, e), rel_err(w, e))
        assert rel_err(g, w) < 2e-2, name


def _dcn() -> nn.Module:
    model = build_model("dcnv2", [50] * 26, 128, bottom_mlp=(64,), deep_mlp=(256, 64),
                        cross_layers=3, cross_rank=128).to(CUDA)
    model.embeddings.requires_grad_(False)  # sparse gradients: not Adam's; the dense part is tested
    return model


def _batches(count: int) -> list:
    gen = torch.Generator(device=CUDA).manual_seed(1)
    out = []
    for _ in range(count):
        dense = torch.randn(2048, 13, device=CUDA, generator=gen)
        ids = torch.randint(0, 50, (2048, 26), device=CUDA, generator=gen)
        out.append((dense, ids, (dense[:, 0] + (ids[:, 0] % 3) > 1).float()))
    return out


def _step(model, opt, dense, ids, labels):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16):
        logits = model(dense, ids)
    loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
    loss.backward()
    opt.step()
    return loss.detach()


def test_dcnv2_with_fused_cross_trains_like_plain():
    batches = _batches(6)
    plain = _dcn()
    fast = copy.deepcopy(plain)
    fast.interaction = FusedCrossNet.from_plain(fast.interaction)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (plain, fast)]
    for batch in batches:
        lp, lf = _step(plain, opts[0], *batch), _step(fast, opts[1], *batch)
        assert abs(float(lp) - float(lf)) < 2e-3
    assert list(fast.state_dict()) == list(plain.state_dict())
    for (name, p), q in zip(plain.named_parameters(), fast.parameters()):
        if name.startswith("embeddings"):
            continue
        # the update, not the weight; Adam's first steps are ~sign(g): tiny gradients may flip
        assert rel_err(q - start[name], p - start[name]) < 0.2, name
        assert rel_err(opts[1].state[q]["exp_avg"], opts[0].state[p]["exp_avg"]) < 0.05, name
        assert rel_err(opts[1].state[q]["exp_avg_sq"], opts[0].state[p]["exp_avg_sq"]) < 0.1, name
    dense, ids, _ = _batches(7)[-1]
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        assert rel_err(fast(dense, ids).float(), plain(dense, ids).float()) < 0.02


def test_compiled_head_with_fused_cross_replays_in_a_cuda_graph():
    batches = _batches(5)
    plain = _dcn()
    eager, graphed = copy.deepcopy(plain), copy.deepcopy(plain)
    eager.interaction = FusedCrossNet.from_plain(eager.interaction)
    assert compile_dense(graphed, fuse_cross=True) and type(graphed.interaction) is FusedCrossNet
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3, capturable=True)
            for m in (eager, graphed)]
    static = [t.clone() for t in batches[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = [_step(graphed, opts[1], *static) for _ in range(2)]  # compile + autotune outside capture
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        _step(eager, opts[0], *batches[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = _step(graphed, opts[1], *static)
    for batch in batches[1:]:
        for dst, src in zip(static, batch):
            dst.copy_(src)
        graph.replay()
        want = _step(eager, opts[0], *batch)
        assert abs(float(loss) - float(want)) < 2e-3, (float(loss), float(want), warm)
    for p, q in zip(eager.parameters(), graphed.parameters()):
        if p.requires_grad:
            assert rel_err(q, p) < 1e-2
