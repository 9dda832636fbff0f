"""Triton kernels of `FusedCrossNet` (`cross.py`): DCNv2's cross-layer elementwise work done in the
epilogue of the layer's rank-r product, so that no [M, N] intermediate makes an extra round trip.

- `cross_forward_kernel`: h = z U^T + b and y = x0 * h + x in one pass (z [M, K], U [N, K]);
  writes h (backward needs it) and y.
- `cross_backward_kernel`: g = dz V + g_in (dz [M, K], V [K, N]; g = g_in without the product),
  then either (last layer) dx0 = g + acc_in, or g (when it was a product), dh = g * x0 (the next
  layer down's bias-side gradient), one fp32 row of column sums of dh per row of tiles (the bias
  gradient, summed on the host side: plain stores, so autotuning's repeated runs stay harmless)
  and acc_out = acc_in + g * h (the x0-gradient so far).

bf16 operands and outputs, fp32 accumulation; values are rounded to bf16 where the plain autocast
path rounds them (h, g) so both paths compute the same numbers up to summation order. N must be a
multiple of one of the tile widths (32, 64, 128) and K of 64 (`cross.py` checks).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_K = 64
# (rows, columns, warps, stages, register cap). A tile's epilogue moves 3-7 [BM, BN] bf16 tiles
# after a short product (K = 512), and on an H200 each program ran the two back to back whatever
# the shape (benchmarks/NOTES.md, "DCNv2, session 3": forward 0.80-0.93 ms = cuBLAS's 0.40 + four
# passes; 4-warp tiles for 2-3 programs per SM, a 128-register cap, and the epilogue's loads issued
# before the product were all tried: none overlapped them). The autotuner picks per shape.
_SHAPES = ((128, 128, 8, 3, None), (64, 128, 4, 3, None), (128, 64, 4, 3, None), (128, 128, 8, 2, 128),
           (128, 32, 4, 3, None), (64, 64, 4, 3, None))
_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, maxnreg=r)
            for bm, bn, w, s, r in _SHAPES]
MIN_BLOCK_M = min(shape[0] for shape in _SHAPES)
MAX_BLOCK_M = max(shape[0] for shape in _SHAPES)


def tile_width(n: int) -> int:
    """The widest tile that divides a row of n columns (0 when none does)."""
    return next((b for b in (128, 64, 32) if n % b == 0), 0)


def _prune(configs, named_args, **kwargs):
    """Tiles that divide a row, 32 wide only where nothing wider does."""
    n, narrowest = named_args["N"], min(64, tile_width(named_args["N"]))
    return [c for c in configs if n % c.kwargs["BLOCK_N"] == 0 and c.kwargs["BLOCK_N"] >= narrowest]


@triton.jit
def _product(a_ptr, b_ptr, off_m, off_n, M, K, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = A[rows, :K] @ B[:K, cols]; A [M, K] row-major, B strides given.
    Rows past M wrap around (their results are masked at the stores)."""
    rm = (off_m + tl.arange(0, BLOCK_M)) % M
    rn = off_n + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    b = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(a), tl.load(b), acc)
        a += BLOCK_K
        b += BLOCK_K * stride_bk
    return acc


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row-tile index, first row, first column, element offsets [BM, BN], row mask) of this program;
    programs next to each other share a row tile (its A rows stay in L2)."""
    pid = tl.program_id(0)
    tiles_n = N // BLOCK_N
    pid_m = pid // tiles_n
    off_m, off_n = pid_m * BLOCK_M, (pid % tiles_n) * BLOCK_N
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    return pid_m, off_m, off_n, at, rows[:, None] < M


@triton.jit
def _loads(ptr, at, inside):
    return tl.load(ptr + at, mask=inside, other=0.0)


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "X_IS_X0"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def cross_forward_kernel(z_ptr, u_ptr, b_ptr, x0_ptr, x_ptr, h_ptr, y_ptr, M, N, K,
                         X_IS_X0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """h = z U^T + b (bf16, as the plain Linear rounds it), y = x0 * h + x; x is x0 when X_IS_X0."""
    _, off_m, off_n, at, inside = _tile(M, N, BLOCK_M, BLOCK_N)
    acc = _product(z_ptr, u_ptr, off_m, off_n, M, K, 1, K, BLOCK_M, BLOCK_N, BLOCK_K)  # U^T: k contiguous
    x0 = _loads(x0_ptr, at, inside)
    x = x0 if X_IS_X0 else _loads(x_ptr, at, inside)
    cols = off_n + tl.arange(0, BLOCK_N)
    h = (acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]).to(tl.bfloat16)
    tl.store(h_ptr + at, h, mask=inside)
    y = x0.to(tl.float32) * h.to(tl.float32) + x.to(tl.float32)
    tl.store(y_ptr + at, y.to(tl.bfloat16), mask=inside)


@triton.jit
def _backward_inputs(gin_ptr, x0_ptr, h_ptr, acc_in_ptr, at, inside, HAS_ACC: tl.constexpr, LAST: tl.constexpr):
    """(g_in, x0, h, acc_in) bf16 tiles; the ones a mode does not read are stand-ins (never used)."""
    gin = _loads(gin_ptr, at, inside)
    acc = _loads(acc_in_ptr, at, inside) if HAS_ACC else tl.zeros_like(gin)
    x0 = gin if LAST else _loads(x0_ptr, at, inside)
    h = gin if LAST else _loads(h_ptr, at, inside)
    return gin, x0, h, acc


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "HAS_DOT", "HAS_ACC", "LAST"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def cross_backward_kernel(dz_ptr, v_ptr, gin_ptr, x0_ptr, h_ptr, acc_in_ptr, g_ptr, dh_ptr, acc_out_ptr,
                          db_ptr, M, N, K, HAS_DOT: tl.constexpr, HAS_ACC: tl.constexpr, LAST: tl.constexpr,
                          MIN_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Module doc. db_ptr: [>= M / MIN_M, N] fp32 in MIN_M-row slots: each program writes its column
    sums into its first slot and zeros into the rest, so every slot holds this run's value whichever
    tile height ran (autotuning runs several on the same buffer)."""
    pid_m, off_m, off_n, at, inside = _tile(M, N, BLOCK_M, BLOCK_N)
    if HAS_DOT:  # V [K, N] row-major: n contiguous
        g = _product(dz_ptr, v_ptr, off_m, off_n, M, K, N, 1, BLOCK_M, BLOCK_N, BLOCK_K)
        gin, x0, h, acc = _backward_inputs(gin_ptr, x0_ptr, h_ptr, acc_in_ptr, at, inside, HAS_ACC, LAST)
        # rounded where autograd rounds: the product to bf16, then the bf16 sum
        g = (g.to(tl.bfloat16).to(tl.float32) + gin.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    else:
        gin, x0, h, acc = _backward_inputs(gin_ptr, x0_ptr, h_ptr, acc_in_ptr, at, inside, HAS_ACC, LAST)
        g = gin.to(tl.float32)
    if LAST:
        tl.store(acc_out_ptr + at, (g + acc.to(tl.float32)).to(tl.bfloat16), mask=inside)
    else:
        if HAS_DOT:
            tl.store(g_ptr + at, g.to(tl.bfloat16), mask=inside)
        dh = (g * x0.to(tl.float32)).to(tl.bfloat16)  # zero in rows past M (x0 loaded as 0 there)
        tl.store(dh_ptr + at, dh, mask=inside)
        cols = off_n + tl.arange(0, BLOCK_N)
        slot = db_ptr + (pid_m * (BLOCK_M // MIN_M)).to(tl.int64) * N + cols
        tl.store(slot, tl.sum(dh.to(tl.float32), axis=0))
        for extra in tl.static_range(1, BLOCK_M // MIN_M):
            tl.store(slot + extra * N, tl.zeros([BLOCK_N], dtype=tl.float32))
        tl.store(acc_out_ptr + at, (acc.to(tl.float32) + g * h.to(tl.float32)).to(tl.bfloat16), mask=inside)
