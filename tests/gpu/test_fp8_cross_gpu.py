"""The fp8 cross layers' Triton row kernels against their torch references, and `Fp8CrossNet` against
the layers' own fp8 formula and bf16: values, gradients, training steps, a CUDA graph replay."""

from __future__ import annotations

import copy

import pytest
import torch

from ctrflow.models.layers import LowRankCrossNet
from ctrflow.accel.fp8.apply import apply_fp8
from ctrflow.accel.fp8.linear import E4M3, E5M2, quantize_rows
from ctrflow.accel.fp8.cross import Fp8CrossNet, cross_dx0, cross_forward, dx0_reference, forward_reference, quantize
from ctrflow.accel.fp8.product import scaled_product, suits
from ctrflow.accel.fp8.wgrad import (cross_dh_tiles, dh_bounds, dh_tiles_reference, row_amax, transposed,
                                     up_weight_grad)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
if not torch.cuda.is_available():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="needs CUDA")]
elif torch.cuda.get_device_capability() < (8, 9):
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="fp8 tensor cores need compute capability 8.9+")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def rows(m: int, n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(m, n, device=CUDA, generator=gen)
    x[::7] *= 40  # rows of other magnitudes
    x[3] = 0  # an all-zero row stays zero
    return x.to(dtype)


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of equal fp8 values. bf16 inputs often land exactly halfway between two fp8 values,
    where x * (TOP / amax) and torch's x / (amax / TOP), an fp32 ulp apart, round to either
    neighbour: ~0.1% of values differ by one fp8 step (measured on an H200)."""
    assert rel_err(a.float(), b.float()) < 0.01  # only such one-step differences
    return float((a.float() == b.float()).float().mean())


@pytest.mark.parametrize("m,n,dtype", [(1000, 3456, torch.bfloat16), (333, 512, torch.bfloat16),
                                       (512, 3456, torch.float32), (100, 864, torch.bfloat16)])
def test_quantize_kernel_matches_quantize_rows(m, n, dtype):
    x = rows(m, n, 0, dtype)
    for fmt in (E4M3, E5M2):
        q, s = quantize(x, fmt)
        q_ref, s_ref = quantize_rows(x, fmt)
        assert q.dtype == fmt and s.shape == (m, 1)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        assert same_fp8(q, q_ref) > 0.995


@pytest.mark.parametrize("shape", [(3456, 512), (512, 3456), (1024, 3456)])
def test_quantize_kernel_reads_a_weights_transpose_in_place(shape):
    weight = rows(*shape, 4, torch.float32)  # fp32 master weights, as the backward products quantize them
    for fmt in (E4M3, E5M2):
        q, s = quantize(weight.t(), fmt)
        q_ref, s_ref = quantize_rows(weight.t().contiguous(), fmt)
        assert q.is_contiguous() and q.shape == (shape[1], shape[0])
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        assert same_fp8(q, q_ref) > 0.995


@pytest.mark.parametrize("n", [3456, 864])
def test_forward_kernel_matches_its_reference(n):
    x0, h, x = rows(1000, n, 1), rows(1000, n, 2), rows(1000, n, 3)
    for inner, quant in ((x0, True), (x, True), (x, False)):
        y, q, s = cross_forward(x0, h, inner, quant)
        y_ref, q_ref, s_ref = forward_reference(x0, h, inner, quant)
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=8e-3, atol=1e-3)  # fma: 1 bf16 ulp at most
        if quant:
            torch.testing.assert_close(s, s_ref, rtol=8e-3, atol=0)
            assert same_fp8(q, q_ref) > 0.995
        else:
            assert q is None and s is None


def dh_of(g, ds, x0) -> torch.Tensor:
    """dh = (g + D's, rounded to bf16 after each sum) * x0 in bf16, as the pass computes it, in fp32."""
    dh = g.float()
    for d in ds:
        dh = (dh + d.float()).bfloat16().float()
    return (dh * x0.float()).bfloat16().float()


def dh_inputs(m: int, extra: int):
    """g, the D's, x0, z's e4m3 row scales and the row bounds of a dh pass."""
    g, x0 = rows(m, 3456, 4), rows(m, 3456, 5)
    ds = [rows(m, 3456, 10 + i) for i in range(extra)]
    _, fold = quantize(rows(m, 512, 6), E4M3)
    return g, ds, x0, fold, dh_bounds([row_amax(t) for t in (g, *ds)], row_amax(x0))


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_dh_tile_kernel_matches_its_reference(extra):
    g, ds, x0, fold, bound = dh_inputs(1000, extra)
    q, s, qt, t_scale, db = cross_dh_tiles(g, ds, x0, E5M2, bound, fold)
    q_ref, s_ref, qt_ref, t_ref, db_ref = dh_tiles_reference(g, ds, x0, E5M2, bound, fold)
    assert q.dtype == E5M2 and qt.dtype == E4M3 and qt.shape == (3456, 1000) and qt.is_contiguous()
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(s, s_ref) and torch.equal(t_scale, t_ref)
    assert same_fp8(qt, qt_ref) > 0.995  # fold * (1 / scale) against fold / scale: an fp32 ulp
    assert rel_err(db, db_ref) < 1e-3  # fp32 sums in another order
    # the bound holds (no value saturates) and is not loose by more than a few binades
    amax = dh_of(g, ds, x0).abs().amax(1)
    assert bool((amax <= bound).all()) and float((bound / amax)[::7].max()) < 64


def test_up_weight_gradient_from_batch_major_copies_tracks_bf16():
    """dU = dh^T z from the pass's e4m3 copy (z's row scales folded in) and z's transposed e4m3 copy,
    against the bf16 product of HEAD: e4m3's error on both operands (3.7% measured), no worse."""
    g, ds, x0, _, bound = dh_inputs(4096, 2)
    z = rows(4096, 512, 6)
    zq, fold = quantize(z, E4M3)
    _, _, qt, t_scale, _ = cross_dh_tiles(g, ds, x0, E5M2, bound, fold)
    z_t = transposed(zq)
    assert torch.equal(z_t.float(), zq.t().float())
    want = dh_of(g, ds, x0).double().t() @ z.double()
    got = up_weight_grad(qt, t_scale, z_t)
    assert got.dtype == torch.float32 and got.shape == (3456, 512)
    assert rel_err(got, want) < 0.05


@pytest.mark.parametrize("layers", [1, 3, 4])
def test_dx0_kernel_matches_its_reference(layers):
    g = rows(777, 3456, 6)
    ds = [rows(777, 3456, 20 + i) for i in range(layers)]
    hs = [rows(777, 3456, 30 + i) for i in range(layers)]
    assert rel_err(cross_dx0(g, ds, hs), dx0_reference(g, ds, hs)) < 5e-3


def cross_nets(layers: int = 3, width: int = 864, rank: int = 512):
    """(bf16 plain, Fp8Linear per layer, Fp8CrossNet) over copies of the same weights, on CUDA."""
    torch.manual_seed(0)
    plain = LowRankCrossNet(width, layers, rank).to(CUDA)
    for up in plain.up:
        torch.nn.init.normal_(up.bias, std=0.3)
    own, fused = torch.nn.Sequential(copy.deepcopy(plain)), torch.nn.Sequential(copy.deepcopy(plain))
    apply_fp8(own, fuse_cross=False)
    apply_fp8(fused)
    assert type(own[0]) is LowRankCrossNet and type(fused[0]) is Fp8CrossNet
    return plain, own[0], fused[0]


def test_fused_cross_net_is_as_accurate_as_the_layers_own_fp8_formula():
    nets = cross_nets()
    x0, grad = rows(4096, 864, 7, torch.float32), torch.randn(4096, 864, device=CUDA)
    results = []
    for net in nets:
        x = x0.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = net(x)
        out.backward(grad.to(out.dtype))
        results.append([out, x.grad, *(p.grad for p in net.parameters())])
    (want, own, got) = results
    errors = [(round(rel_err(a, c), 4), round(rel_err(b, c), 4)) for a, b, c in zip(got, own, want)]
    assert got[0].dtype == torch.bfloat16 and errors[0][0] < 0.12, errors  # 3 layers of e4m3 products
    for mine, theirs in errors:  # output, x0 gradient, every weight and bias gradient
        assert mine < 1.15 * theirs + 0.01, errors


@pytest.mark.parametrize("beside", [False, True])  # weight-gradient products in line or on a side stream
def test_fused_cross_training_replays_in_a_cuda_graph_and_tracks_bf16(beside):
    plain, _, fused = cross_nets(layers=2)
    fused.wgrad_beside = beside
    graphed = copy.deepcopy(fused)
    nets = (plain, fused, graphed)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True) for m in nets]
    start = [p.detach().clone() for p in plain.parameters()]
    x0s = [rows(2048, 864, 40 + i, torch.float32) for i in range(5)]

    def step(net, opt, x0):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = (net(x0).float() - x0.flip(1)).square().mean()
        loss.backward()
        opt.step()

    static = x0s[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: kernel compiles, optimizer state
        step(graphed, opts[2], static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, opts[2], static)
    for net, opt in zip(nets[:2], opts[:2]):
        step(net, opt, x0s[0])  # the warm-up step
    for x0 in x0s[1:]:
        static.copy_(x0)
        graph.replay()
        for net, opt in zip(nets[:2], opts[:2]):
            step(net, opt, x0)
    torch.cuda.synchronize()
    for p, q, r, s in zip(plain.parameters(), fused.parameters(), graphed.parameters(), start):
        assert rel_err(r, q) < 1e-5  # the graph replays the eager kernels
        assert rel_err(q - s, p - s) < 0.4  # Adam's first steps are ~sign(g): small gradients flip


def test_kernels_read_and_write_x0_in_two_parts_as_one_tensor():
    """DCNv2's x0 = [dense arch output, lookups] is handed over in two parts, never concatenated:
    every kernel touching x0 gives the very values it gives on the concatenated tensor."""
    x0, h, x, g = rows(1000, 3456, 50), rows(1000, 3456, 51), rows(1000, 3456, 52), rows(1000, 3456, 53)
    parts = (x0[:, :128].contiguous(), x0[:, 128:].contiguous())
    for got, want in zip(quantize(parts, E4M3), quantize(x0, E4M3)):
        assert torch.equal(got.float(), want.float())
    for inner_parts, inner in ((parts, x0), (x, x)):
        for got, want in zip(cross_forward(parts, h, inner_parts, True), cross_forward(x0, h, inner, True)):
            assert torch.equal(got.float(), want.float())
    ds = [rows(1000, 3456, 60 + i) for i in range(2)]
    fold, bound = quantize(rows(1000, 512, 61), E4M3)[1], dh_bounds([row_amax(g)], row_amax(x0))
    for got, want in zip(cross_dh_tiles(g, ds, parts, E5M2, bound, fold), cross_dh_tiles(g, ds, x0, E5M2, bound, fold)):
        assert torch.equal(got.float(), want.float())
    hs = [rows(1000, 3456, 70 + i) for i in range(2)]
    lead, rest = cross_dx0(g, ds, hs, lead=128)
    assert lead.is_contiguous() and rest.is_contiguous()
    assert torch.equal(torch.cat([lead, rest], dim=1), cross_dx0(g, ds, hs))


def test_fused_cross_net_takes_x0_in_two_parts():
    _, _, fused = cross_nets()
    x0, grad = rows(4096, 864, 80, torch.float32), torch.randn(4096, 864, device=CUDA)
    results = []
    for split in (False, True):
        net = copy.deepcopy(fused)
        x = x0.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = net(x[:, :96], x[:, 96:]) if split else net(x)
        out.backward(grad.to(out.dtype))
        results.append([out, x.grad, *(p.grad for p in net.parameters())])
    for got, want in zip(*results):
        # the first down layer's weight gradient comes from two bf16 products: cuBLAS may split their
        # sums otherwise, and a few values round to the neighbouring bf16 (measured: 3.7e-5)
        assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("m,n,k,fmt,bias", [(65536, 3456, 512, E4M3, True), (1000, 3456, 512, E5M2, False),
                                            (777, 864, 256, E4M3, True)])
def test_short_product_kernel_matches_scaled_mm(m, n, k, fmt, bias):
    aq, a_scale = quantize(rows(m, k, 90), fmt)
    bq, b_scale = quantize(rows(n, k, 91), E4M3)
    b = rows(8, n, 92)[0] if bias else None
    assert suits(aq, bq, fast=True)
    amax = torch.zeros(m, device=CUDA)
    got = scaled_product(aq, a_scale, bq, b_scale, b, amax)
    want = torch._scaled_mm(aq, bq.t(), scale_a=a_scale, scale_b=b_scale.t(), bias=b, out_dtype=torch.bfloat16,
                            use_fast_accum=True)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel_err(got, want) < 2e-3  # fp32 sums in another order, then one bf16 rounding
    assert torch.equal(amax, row_amax(got))  # each row's largest |value|, as stored
