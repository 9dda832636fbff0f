"""The fp8 product with row scales for short reductions (K <= 512), in Triton.

DCNv2's rank-512 up products (h = z U^T + b, and backward D = dz V) write a [M, 3456] bf16 output from
only K = 512: cuBLAS's kernel (one tile per SM at a time) runs them at ~870 TFLOP/s, its epilogue and
output stores not hidden behind the products. Here two persistent programs share each SM, so one's
epilogue (scales, bias, two half-tile stores) runs while the other's tensor cores work: 234-243 us
against cuBLAS's 258-268 at M = 65,536 on an H200 (benchmarks/NOTES.md). Longer reductions stay on
cuBLAS, whose kernels win there, unless the caller needs each output row's amax, which the epilogue
here emits (`wgrad`'s row bounds; +27 us at K = 512, and DCNv2's K = 1,024 product 419 us against
cuBLAS's 370 without it).
"""

from __future__ import annotations

import functools

import torch

try:  # the kernel compiler exists only where CUDA does
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

MAX_K = 512
# tile, pipeline depth, warps, programs per SM (the fastest of 20 shapes timed, NOTES.md)
TILE = {"m": 128, "n": 128, "k": 128, "stages": 3, "warps": 4, "per_sm": 2, "group": 8}


def suits(a: torch.Tensor, b: torch.Tensor, fast: bool, max_k: int | None = MAX_K) -> bool:
    """Whether the kernel computes a [M, K] @ b [N, K]^T: fp8 CUDA tensors, K <= max_k (None: any K),
    fast accumulation (as `_scaled_mm(use_fast_accum=True)`), rows aligned to 16 bytes as the tensor copy
    engine needs."""
    return (triton is not None and fast and a.is_cuda and (max_k is None or a.shape[1] <= max_k)
            and a.shape[1] % 16 == 0 and b.shape[1] == a.shape[1] and b.shape[0] % 8 == 0
            and a.is_contiguous() and b.is_contiguous())


if triton is not None:
    @triton.jit
    def _tile(tile, num_m, num_n, GROUP: tl.constexpr):
        """(row block, column block) of tile number `tile`: GROUP row blocks sweep the columns together,
        so their rows of a stay in L2."""
        in_group = GROUP * num_n
        first_m = (tile // in_group) * GROUP
        size_m = tl.minimum(num_m - first_m, GROUP)
        return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m

    @triton.jit
    def _epilogue(acc, c_desc, sa, sb_ptr, bias_ptr, om, on, N, HAS_BIAS: tl.constexpr, BN: tl.constexpr):
        """acc * sa * sb (+ bias) as bf16 into c at (om, on); returns its rows' largest |value| [BM] (columns
        past N are 0)."""
        cols = on + tl.arange(0, BN)
        acc = acc * sa[:, None] * tl.load(sb_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out = acc.to(tl.bfloat16)
        c_desc.store([om, on], out)
        return tl.max(tl.abs(tl.where(cols[None, :] < N, out.to(tl.float32), 0.0)), axis=1)

    @triton.jit
    def scaled_product_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, bias_ptr, amax_ptr, M, N, K,
                              PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, AMAX: tl.constexpr):
        """c = (a @ b^T) * sa[:, None] * sb[None, :] (+ bias), bf16; persistent over the tiles; with AMAX,
        each row's largest |c| into amax [M] (fp32 bits as int32: an integer atomic max)."""
        num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
            pid_m, pid_n = _tile(tile, num_m, num_n, GROUP)
            om, on = pid_m * BM, pid_n * BN
            acc = tl.zeros((BM, BN), tl.float32)
            for k in range(0, tl.cdiv(K, BK)):
                acc = tl.dot(a_desc.load([om, k * BK]), b_desc.load([on, k * BK]).T, acc)
            rows = om + tl.arange(0, BM)
            sa = tl.load(sa_ptr + rows, mask=rows < M, other=0.0)
            # two half-tile stores: half the staging memory, so two programs fit on an SM
            left, right = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            top = _epilogue(left, c_desc, sa, sb_ptr, bias_ptr, om, on, N, HAS_BIAS, BN // 2)
            top = tl.maximum(top, _epilogue(right, c_desc, sa, sb_ptr, bias_ptr, om, on + BN // 2, N, HAS_BIAS,
                                            BN // 2))
            if AMAX:
                tl.atomic_max(amax_ptr + rows, top.to(tl.int32, bitcast=True), mask=rows < M, sem="relaxed")


@functools.cache
def sm_count(index: int) -> int:
    """Multiprocessors of CUDA device `index` (persistent grids size themselves by it)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def scaled_product(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, amax: torch.Tensor | None = None) -> torch.Tensor:
    """(a [M, K] @ b [N, K]^T) * a_scale [M, 1] * b_scale [N, 1]^T (+ bias [N]) in bf16 [M, N], as
    `torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t(), bias=bias, use_fast_accum=True)`
    (fp32 sums; where `suits`); with `amax` (fp32 [M], zeros), each output row's largest |value| into it."""
    (m, k), n, t = a.shape, b.shape[0], TILE
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    tiles = triton.cdiv(m, t["m"]) * triton.cdiv(n, t["n"])
    programs = max(1, min(tiles, sm_count(a.device.index or 0) * t["per_sm"]))
    scaled_product_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [t["m"], t["k"]]), TensorDescriptor.from_tensor(b, [t["n"], t["k"]]),
        TensorDescriptor.from_tensor(out, [t["m"], t["n"] // 2]), a_scale.contiguous(), b_scale.contiguous(),
        b_scale if bias is None else bias, out if amax is None else amax.view(torch.int32), m, n, k,
        PROGRAMS=programs, BM=t["m"], BN=t["n"], BK=t["k"], GROUP=t["group"], HAS_BIAS=bias is not None,
        AMAX=amax is not None, num_stages=t["stages"], num_warps=t["warps"])
    return out
