"""The fp8 up-layer weight gradient's algebra (`ctrflow.accel.fp8.wgrad`) in its torch form (the CPU's):
row bounds that never saturate, batch-major copies, and a gradient as close to the exact one as fp8 allows."""

from __future__ import annotations

import torch

from ctrflow.accel.fp8.linear import E4M3, E5M2, quantize_rows
from ctrflow.accel.fp8.wgrad import cross_dh_tiles, dh_bounds, row_amax, transposed, up_weight_grad


def spread_rows(m: int, n: int, seed: int) -> torch.Tensor:
    """bf16 rows whose magnitudes span ~2^10, as per-sample gradients do; one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=gen) * torch.exp2(torch.rand(m, 1, generator=gen) * 10 - 5)
    x[5] = 0
    return x.bfloat16()


def test_dh_copies_use_row_bounds_that_hold_and_carry_the_gradient():
    m, n = 512, 96
    g, x0 = spread_rows(m, n, 1), spread_rows(m, n, 2)
    ds = [spread_rows(m, n, 3 + i) for i in range(2)]
    _, fold = quantize_rows(spread_rows(m, 32, 9), E4M3)
    bound = dh_bounds([row_amax(t) for t in (g, *ds)], row_amax(x0))
    q, scale, qt, t_scale, bias_grad = cross_dh_tiles(g, ds, (x0[:, :16], x0[:, 16:]), E5M2, bound, fold)
    dh = g.float()
    for d in ds:
        dh = (dh + d.float()).bfloat16().float()
    dh = (dh * x0.float()).bfloat16().float()
    assert bool((dh.abs().amax(1) <= bound).all())  # the bound holds: nothing saturates
    assert torch.equal(q[5].float(), torch.zeros(n))  # the zero row stays zero (scale clamped, no NaN)
    assert float(((q.float() * scale - dh).norm() / dh.norm())) < 0.1  # e5m2: 2 digits
    assert qt.shape == (n, m) and qt.dtype == E4M3 and qt.is_contiguous()
    folded = dh * fold
    assert float(((qt.float().t() * t_scale - folded).norm() / folded.norm())) < 0.05  # e4m3: 3 digits
    torch.testing.assert_close(bias_grad, dh.sum(0))


def test_up_weight_gradient_from_fp8_copies_is_near_the_exact_one():
    m, n, r = 2048, 128, 64
    g, x0, z = spread_rows(m, n, 11), spread_rows(m, n, 12), spread_rows(m, r, 13)
    zq, fold = quantize_rows(z, E4M3)
    bound = dh_bounds([row_amax(g)], row_amax(x0))
    _, _, qt, t_scale, _ = cross_dh_tiles(g, [], x0, E5M2, bound, fold)
    z_t = transposed(zq)
    assert torch.equal(z_t.float(), zq.float().t())
    got = up_weight_grad(qt, t_scale, z_t)
    want = (g.float() * x0.float()).bfloat16().double().t() @ z.double()
    assert got.shape == (n, r) and got.dtype == torch.float32
    assert float((got.double() - want).norm() / want.norm()) < 0.05  # e4m3 on both operands
