"""Triton kernels of the fp8 cross layers (`ctrflow.accel.fp8.cross` and `.wgrad` launch them; their
docs say what each computes and why).

Memory-bound row kernels: each program owns whole rows, a [ROWS, BLOCK_N] block with BLOCK_N the
next power of two >= N (4096 for N = 3456), so a row's amax, scale and fp8 copy come out of the
registers of the very pass that produces the row. Math in fp32; every tensor the torch path would
round to bf16 is rounded here too (y, dh, each partial gradient sum), then quantized from those bf16
values, as `ctrflow.accel.fp8.linear.quantize_rows` does. The dh pass (`cross_dh_tiles_kernel`) works on
[R, BC] tiles instead, with scales known before it, so that its batch-major copy's stores write
whole R-row segments (`ctrflow.accel.fp8.wgrad`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _offsets(block, M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows [ROWS], offsets [ROWS, BLOCK_N] int64, mask) of row block `block`."""
    rows = block * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows, rows[:, None].to(tl.int64) * N + cols[None, :], mask


@triton.jit
def _load(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _x0_at(rows, M, N, LEAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where x0's block of `rows` lies: (offsets into the first part, its mask, offsets into the rest,
    its mask). x0 [M, N] is one tensor (LEAD 0: the first part is all of it), or two: its first LEAD
    columns [M, LEAD] and the others [M, N - LEAD] (DCNv2: the dense arch's output and the lookups,
    never concatenated into a copy)."""
    r = rows[:, None].to(tl.int64)
    c = tl.arange(0, BLOCK_N)[None, :]
    ok = r < M
    if LEAD == 0:
        return r * N + c, ok & (c < N), r * N + c, ok & (c < 0)
    return r * LEAD + c, ok & (c < LEAD), r * (N - LEAD) + (c - LEAD), ok & (c >= LEAD) & (c < N)


@triton.jit
def _load_x0(x0_ptr, rest_ptr, rows, M, N, LEAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """x0's rows [ROWS, BLOCK_N] in fp32 (masked lanes 0), from its one or two parts (`_x0_at`)."""
    at, mask, rest_at, rest_mask = _x0_at(rows, M, N, LEAD, BLOCK_N)
    x0 = _load(x0_ptr, at, mask)
    if LEAD > 0:
        x0 += _load(rest_ptr, rest_at, rest_mask)
    return x0


@triton.jit
def _store_x0(v, x0_ptr, rest_ptr, rows, M, N, LEAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store rows v [ROWS, BLOCK_N] into x0's one or two parts (`_x0_at`)."""
    at, mask, rest_at, rest_mask = _x0_at(rows, M, N, LEAD, BLOCK_N)
    tl.store(x0_ptr + at, v, mask=mask)
    if LEAD > 0:
        tl.store(rest_ptr + rest_at, v, mask=rest_mask)


@triton.jit
def _bf16(v):
    """v rounded to bf16, back in fp32 (what a bf16 tensor op would have stored)."""
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _quantize_store(v, q_ptr, s_ptr, rows, offs, mask, M, TOP: tl.constexpr):
    """Row scales of v [ROWS, BLOCK_N] (fp32; masked lanes 0) and its fp8 copy: amax / TOP, as
    `quantize_rows`, whose v / scale becomes v * (TOP / amax) here: one IEEE division per row, not
    per value (~20 instructions each: as many as the pass's bytes allow); a value lands on the
    other side of an fp8 rounding boundary only within an fp32 ulp of it."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)  # [ROWS]
    scale = tl.div_rn(amax, tl.zeros_like(amax) + TOP)
    inverse = tl.div_rn(tl.zeros_like(amax) + TOP, amax)
    q = tl.minimum(tl.maximum(v * inverse[:, None], -TOP), TOP)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < M)


@triton.jit
def quantize_rows_kernel(x_ptr, rest_ptr, q_ptr, s_ptr, M, N, stride_m, stride_n, TOP: tl.constexpr,
                         LEAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """q, s = rows of x [M, N] (strides stride_m, stride_n: e.g. a weight's transpose, read in place;
    with LEAD, x is x0 in two contiguous parts as `_x0_at` says) in fp8 with one scale per row; q
    contiguous."""
    rows, offs, mask = _offsets(tl.program_id(0), M, N, ROWS, BLOCK_N)
    if LEAD > 0:
        x = _load_x0(x_ptr, rest_ptr, rows, M, N, LEAD, BLOCK_N)
    else:
        at = rows[:, None].to(tl.int64) * stride_m + tl.arange(0, BLOCK_N)[None, :].to(tl.int64) * stride_n
        x = _load(x_ptr, at, mask)
    _quantize_store(x, q_ptr, s_ptr, rows, offs, mask, M, TOP)


@triton.jit
def cross_forward_kernel(x0_ptr, rest_ptr, h_ptr, x_ptr, y_ptr, q_ptr, s_ptr, M, N, TOP: tl.constexpr,
                         LEAD: tl.constexpr, X_IS_X0: tl.constexpr, QUANT: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """y = x0 * h + x (bf16), and (QUANT) its e4m3 copy with row scales."""
    rows, offs, mask = _offsets(tl.program_id(0), M, N, ROWS, BLOCK_N)
    x0 = _load_x0(x0_ptr, rest_ptr, rows, M, N, LEAD, BLOCK_N)
    if X_IS_X0:
        x = x0
    else:
        x = _load(x_ptr, offs, mask)
    y = (x0 * _load(h_ptr, offs, mask) + x).to(tl.bfloat16)
    tl.store(y_ptr + offs, y, mask=mask)
    if QUANT:
        _quantize_store(y.to(tl.float32), q_ptr, s_ptr, rows, offs, mask, M, TOP)


@triton.jit
def _take(acc, g, d_ptr, h_ptr, offs, mask):
    """One layer, top down: acc += G_{l+1} * h_l; returns (acc, G_l = G_{l+1} + D_l in bf16)."""
    acc += g * _load(h_ptr, offs, mask)
    return acc, _bf16(g + _load(d_ptr, offs, mask))


@triton.jit
def cross_dx0_kernel(g_ptr, d0_ptr, d1_ptr, d2_ptr, d3_ptr, h0_ptr, h1_ptr, h2_ptr, h3_ptr, out_ptr, rest_ptr, M, N,
                     LEAD: tl.constexpr, L: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx0 = sum_l G_{l+1} * h_l + G_0 with G_l = G_{l+1} + D_l, layers top down (d0/h0 the top), into
    x0's one or two parts."""
    rows, offs, mask = _offsets(tl.program_id(0), M, N, ROWS, BLOCK_N)
    g = _load(g_ptr, offs, mask)
    acc, g = _take(tl.zeros_like(g), g, d0_ptr, h0_ptr, offs, mask)
    if L > 1:
        acc, g = _take(acc, g, d1_ptr, h1_ptr, offs, mask)
    if L > 2:
        acc, g = _take(acc, g, d2_ptr, h2_ptr, offs, mask)
    if L > 3:
        acc, g = _take(acc, g, d3_ptr, h3_ptr, offs, mask)
    _store_x0((acc + g).to(tl.bfloat16), out_ptr, rest_ptr, rows, M, N, LEAD, BLOCK_N)


@triton.jit
def _load_x0_tile(x0_ptr, rest_ptr, r, c, M, N, LEAD: tl.constexpr):
    """x0's tile at rows r [R, 1] (int64) and columns c [1, BC] in fp32 (masked lanes 0), from its one or
    two parts (`_x0_at`)."""
    if LEAD == 0:
        return _load(x0_ptr, r * N + c, (r < M) & (c < N))
    x0 = _load(x0_ptr, r * LEAD + c, (r < M) & (c < LEAD))
    return x0 + _load(rest_ptr, r * (N - LEAD) + (c - LEAD), (r < M) & (c >= LEAD) & (c < N))


@triton.jit
def cross_dh_tiles_kernel(g_ptr, d0_ptr, d1_ptr, d2_ptr, x0_ptr, rest_ptr, q_ptr, qt_ptr, inv_ptr, inv_t_ptr,
                          fold_ptr, parts_ptr, M, N, row_programs, iters, TOP: tl.constexpr, TOP_T: tl.constexpr,
                          LEAD: tl.constexpr, ND: tl.constexpr, R: tl.constexpr, BC: tl.constexpr):
    """G = ((g + d0) + d1) + d2 (the first ND; rounded to bf16 after each sum) and dh = G * x0 (bf16
    values) over [R, BC] tiles with the scales known ahead (row bounds, not the row's amax): dh's fp8
    copy q = dh * inv[row], its batch-major copy qt[col, row] = dh * fold[row] * inv_t (one scale),
    and per (row program, column block) the column sums of dh in parts[row program]; no bf16 dh.
    Program (column block, row program) strides over the row blocks."""
    pc, pr = tl.program_id(0), tl.program_id(1)
    cols = pc * BC + tl.arange(0, BC)
    c = cols[None, :]
    inv_t = tl.load(inv_t_ptr)
    # loads not pipelined through shared memory (the top layer's pass: 493 us with Triton's default 3 stages
    # and 4 programs per SM, 446 without at 8), column sums reduced once at the end, not per tile (407 us;
    # measured on an H200, benchmarks/NOTES.md)
    acc = tl.zeros([R, BC], dtype=tl.float32)
    for i in tl.range(0, iters, num_stages=1):
        rows = (pr + i * row_programs) * R + tl.arange(0, R)
        r = rows[:, None].to(tl.int64)
        mask = (r < M) & (c < N)
        offs = r * N + c
        g = _load(g_ptr, offs, mask)
        if ND > 0:
            g = _bf16(g + _load(d0_ptr, offs, mask))
        if ND > 1:
            g = _bf16(g + _load(d1_ptr, offs, mask))
        if ND > 2:
            g = _bf16(g + _load(d2_ptr, offs, mask))
        dh = _bf16(g * _load_x0_tile(x0_ptr, rest_ptr, r, c, M, N, LEAD))
        acc += dh
        inv = tl.load(inv_ptr + rows, mask=rows < M, other=0.0)
        q = tl.minimum(tl.maximum(dh * inv[:, None], -TOP), TOP)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        fold = tl.load(fold_ptr + rows, mask=rows < M, other=0.0)
        qt = tl.minimum(tl.maximum(dh * (fold * inv_t)[:, None], -TOP_T), TOP_T)
        tl.store(qt_ptr + c.to(tl.int64) * M + r, qt.to(qt_ptr.dtype.element_ty), mask=mask)
    tl.store(parts_ptr + pr * N + cols, tl.sum(acc, axis=0), mask=cols < N)


@triton.jit
def transpose_kernel(x_ptr, y_ptr, M, N, R: tl.constexpr, BC: tl.constexpr):
    """y [N, M] = x [M, N]^T (any element type: fp8 copies made batch-major)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    r, c = rows[:, None].to(tl.int64), cols[None, :]
    mask = (r < M) & (c < N)
    tl.store(y_ptr + c.to(tl.int64) * M + r, tl.load(x_ptr + r * N + c, mask=mask), mask=mask)
