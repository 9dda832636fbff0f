"""fp8 weight gradients of the cross layers' up products, dU_l = dh_l^T z_l [N, r] (`ctrflow.accel.fp8.cross`'s
notation: h_l = U_l z_l + b_l, z_l = V_l x_l), from batch-major copies.

Hopper's fp8 products (cuBLAS) take both operands K-major, and a weight gradient's K is the batch, so
each operand needs a batch-major fp8 copy. Made apart, the wide one's transpose costs what fp8 saves
(benchmarks/NOTES.md, "DCNv2 on one GPU"). Here it comes out of the pass that makes dh, in place of
that pass's bf16 dh, which only the bf16 product read: `cross_dh_tiles` works on [R, BC] tiles, so
its batch-major stores write whole R-row segments, and tiles cannot see a row's amax. Its scales are
therefore known before the pass:

- rows: |dh_i| <= (max|g_i| + sum_k max|D_k,i|) * max|x0_i| (G = g + D's, dh = G * x0); the products
  that make g and the D's emit their rows' amax (`fp8_product.scaled_product(amax=)`), x0's comes with
  its e4m3 copy. A loose bound costs e5m2 nothing but range at the bottom (30 binades), not digits
  (random rows, M 65,536: bound / amax median 2.8, never below 1);
- the batch-major copy: e4m3 (one more digit than e5m2: its weight gradient's error 3.7% against 5.9%
  for random rows), one scale, the largest row bound; the rows' spread fits e4m3's 17 binades.

z [M, r] (narrow) keeps the e4m3 copy and row scales its forward product made: the batch-major
operand is a byte transpose of that copy, and z's row scales are folded into dh's batch-major copy
(a scale along the batch cannot stay with z: it would sit inside the sum).
The CPU (and any input the kernels do not take) runs the same algebra in torch (`*_reference`).
"""

from __future__ import annotations

import torch

from ctrflow.accel.fp8 import product as fp8_product
from ctrflow.accel.fp8.linear import E4M3

try:  # the kernel compiler exists only where CUDA does
    import triton

    from ctrflow.accel.fp8 import kernels as K
except ImportError:  # pragma: no cover - depends on the machine
    triton = K = None

BF16 = torch.bfloat16
SLACK = 1.02  # dh's up to four bf16 roundings (each <= 2^-8) on top of the bound
# tile rows x columns, warps, programs per SM (benchmarks/NOTES.md, "DCNv2 on one GPU")
TILES = {"dh": (64, 64, 4, 8), "transpose": (128, 64, 4)}


def x0_parts(x0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(first part, other part, LEAD) of x0: one [M, N] tensor (itself twice, LEAD 0), or a pair
    (lead [M, LEAD], rest [M, N - LEAD]) read in place by the kernels (`kernels._x0_at`); here
    because `cross`, which imports this module, needs it too."""
    return (x0, x0, 0) if isinstance(x0, torch.Tensor) else (x0[0], x0[1], x0[0].shape[1])


def x0_whole(x0) -> torch.Tensor:
    """x0 as one tensor (the torch references: a concatenated copy)."""
    return x0 if isinstance(x0, torch.Tensor) else torch.cat(x0, dim=1)


def _kernels(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take t (CUDA, and Triton installed)."""
    return t.is_cuda and K is not None


def row_amax(t: torch.Tensor) -> torch.Tensor:
    """Each row's largest |value| in fp32 [M] (where no product emitted it)."""
    return t.abs().amax(dim=1).float()


def dh_bounds(amaxes: list[torch.Tensor], x0_amax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of |dh| per row [M] from the row amaxes of g and the D's, and x0's."""
    return (torch.stack(amaxes).sum(0) * x0_amax.view(-1) * SLACK).clamp(min=1e-12)


def dh_tiles_reference(g, ds, x0, dtype, bound, fold):
    """(q, row scales [M, 1], batch-major e4m3 copy [N, M], its scale, bias gradient fp32 [N]) as
    `cross_dh_tiles_kernel`."""
    top = torch.finfo(dtype).max
    x0 = x0_whole(x0)
    g = g.float()
    for d in ds:
        g = (g + d.float()).to(BF16).float()
    dh = (g * x0.float()).to(BF16).float()
    t_top, fold = torch.finfo(E4M3).max, fold.view(-1)
    t_scale = (bound * fold).max() / t_top
    q = (dh * (top / bound)[:, None]).clamp(-top, top).to(dtype)
    qt = (dh * (fold / t_scale)[:, None]).clamp(-t_top, t_top).to(E4M3).t().contiguous()
    return q, (bound / top)[:, None], qt, t_scale, dh.sum(0)


def cross_dh_tiles(g: torch.Tensor, ds: list[torch.Tensor], x0, dtype: torch.dtype, bound: torch.Tensor,
                   fold: torch.Tensor):
    """dh = (g + ds[0] + ...) * x0 (at most 3 ds; x0 one tensor or two parts) as fp8 copies: row-major
    with row scales bound / TOP [M, 1]; batch-major [N, M] e4m3 of dh * fold (z's row scales [M, 1]),
    one scale; and dh's column sums (the bias gradient, fp32 [N]); in one pass (module doc)."""
    if not _kernels(g):
        return dh_tiles_reference(g, ds, x0, dtype, bound, fold)
    first, rest, lead = x0_parts(x0)
    (m, n), top = g.shape, torch.finfo(dtype).max
    rows, cols, warps, per_sm = TILES["dh"]
    col_blocks = triton.cdiv(n, cols)
    programs = max(1, min(triton.cdiv(m, rows), fp8_product.sm_count(g.device.index or 0) * per_sm // col_blocks))
    q = torch.empty(m, n, dtype=dtype, device=g.device)
    qt = torch.empty(n, m, dtype=E4M3, device=g.device)
    parts = torch.empty(programs, n, dtype=torch.float32, device=g.device)  # every row written
    t_top, fold = torch.finfo(E4M3).max, fold.view(-1)
    t_scale = (bound * fold).max() / t_top
    d = [*ds, g, g, g][:3]
    K.cross_dh_tiles_kernel[(col_blocks, programs)](
        g, *d, first, rest, q, qt, top / bound, 1 / t_scale, fold, parts, m, n, programs,
        triton.cdiv(triton.cdiv(m, rows), programs), TOP=top, TOP_T=t_top, LEAD=lead, ND=len(ds), R=rows, BC=cols,
        num_warps=warps)
    return q, (bound / top)[:, None], qt, t_scale, parts.sum(0)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """t [M, r] batch-major: [r, M] contiguous (z's e4m3 copy: one byte transpose, no new scales)."""
    if not _kernels(t):
        return t.t().contiguous()
    (m, r), (rows, cols, warps) = t.shape, TILES["transpose"]
    out = torch.empty(r, m, dtype=t.dtype, device=t.device)
    K.transpose_kernel[(triton.cdiv(m, rows), triton.cdiv(r, cols))](t, out, m, r, R=rows, BC=cols, num_warps=warps)
    return out


def up_weight_grad(dh_t: torch.Tensor, t_scale: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
    """dU = dh^T z [N, r] in fp32 (fp32 sums) from dh's batch-major copy with z's row scales folded in
    and z's batch-major e4m3 copy."""
    if not dh_t.is_cuda:
        return (dh_t.float() @ z_t.float().t()) * t_scale
    (n, r), dev = (dh_t.shape[0], z_t.shape[0]), dh_t.device
    ones = torch.ones(n, 1, dtype=torch.float32, device=dev)
    return torch._scaled_mm(dh_t, z_t.t(), scale_a=ones, scale_b=t_scale.expand(1, r).contiguous(),
                            out_dtype=torch.float32)
