"""FP8 matrix products for the large dense layers (`--precision fp8`, CUDA sm89+ only).

An `Fp8Linear` is an `nn.Linear` (same parameters, same state-dict keys: checkpoints cross paths)
whose forward product and input-gradient product run on the fp8 tensor cores through
`torch._scaled_mm`, which needs A row-major and B column-major, K and N multiples of 16:

- forward  y  = x W^T + b: x [M, K] as e4m3 with one scale per row, W [N, K] as e4m3 with one
  scale per output row (B = W^T is then column-major as stored);
- backward dx = g W: g [M, N] as `grad_dtype` (e5m2 by default: gradients need range more than
  digits) with one scale per row, W^T made contiguous [K, N] as e4m3 with one scale per input
  column;
- dW = g^T x stays a bf16 product (its operands would need batch-major fp8 copies: two more passes
  over [M, K]) writing fp32, db = column sums of g in fp32 (`column_sums`). Accumulation is fp32
  unless `fast_accum` (Hopper's faster fp8 accumulation, ~10% more TFLOP/s, fewer accumulator bits).

Which products pay: quantizing an [M, W] operand costs at least one write of M x W bytes (and, when
not fused into its producer, a read of 2 M x W more), while fp8 saves 2 M x W x N x (1/R_bf16 -
1/R_fp8) for a product of output width N. `rule="widening"` therefore puts in fp8 only the products
whose quantized operand is the narrow side (N >= W): the forward of a widening layer and the
input-gradient of a narrowing one; `rule="all"` both products of every layer.

`apply_fp8`'s defaults (all products, fast accumulation) are what measured fastest on an H200 for
DCNv2 at batch 65,536 (benchmarks/NOTES.md, "DCNv2 on one GPU"): 4.61-4.65 M samples/s against
4.33-4.35 M for bf16 in the same runs, 4.47 M for all products with fp32 accumulation, 4.53 M for
the widening rule with fast accumulation. AUC after 100 steps vs the plain fp32 path: |delta| 5.7e-4
and 1.19e-3 in two runs (the bf16 fast path's own: 0.7e-4 and 9.1e-4): at the 0.001 gate's edge,
so fp8 is an explicit opt-in, never a default.

Row scales (amax of each row / the format's largest value) keep a row's outliers from flattening
the others, and, being per-row reductions, fuse under `torch.compile` into the kernel that
produces the row (the cross layer's `x0 * h + x`) — as looped reductions that read each row two or
three times (benchmarks/NOTES.md). DCNv2's cross layers therefore become an
`ctrflow.accel.fp8.cross.Fp8CrossNet` (`apply_fp8(fuse_cross=True)`, the default): hand-written row
kernels that produce each row, its amax and its fp8 copy in one pass: 4.74-4.78 M samples/s against
4.67 M for the Fp8Linear layers under inductor and 4.35 M in bf16 (one H200; benchmarks/NOTES.md);
AUC over 3 seeds at the gate's edge (|mean delta| 0.3e-4, 9.3e-4, 9.1e-4 in three runs). Master weights, optimizer state
and every other elementwise op stay as they were (fp32 / bf16 autocast).
"""

from __future__ import annotations

import torch
from torch import nn

from ctrflow.errors import UserError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD_DTYPES = {"e5m2": E5M2, "e4m3": E4M3}


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `dtype`, scale [M, 1] fp32) with x ≈ q * scale; each row's largest
    |x| maps to the format's largest value (all-zero rows get a tiny scale and stay zero)."""
    top = torch.finfo(dtype).max
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / top
    q = (x.float() / scale).clamp(-top, top).to(dtype)
    return q, scale


def quantize_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `quantize_rows` with one scale for the whole tensor (a scalar fp32 tensor)."""
    top = torch.finfo(dtype).max
    scale = x.abs().amax().float().clamp(min=1e-12) / top
    return (x.float() / scale).clamp(-top, top).to(dtype), scale


def _scaled(a: torch.Tensor, a_dtype: torch.dtype, b_rows: torch.Tensor, rowwise: bool, fast: bool,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b_rows [N, K]^T in fp8 with fp32 accumulation -> bf16 [M, N] (+ bias)."""
    quantize = quantize_rows if rowwise else quantize_tensor
    aq, sa = quantize(a, a_dtype)
    bq, sb = quantize(b_rows, E4M3)
    # bq.t(): [K, N] column-major, the layout _scaled_mm wants for B; row scales of b -> [1, N]
    return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t() if rowwise else sb,
                            bias=None if bias is None else bias.to(torch.bfloat16),
                            out_dtype=torch.bfloat16, use_fast_accum=fast)


def weight_grad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a^T b [A, B] in fp32 from bf16 a [M, A] and b [M, B] (M: the batch); on CUDA the product writes
    fp32 itself: no bf16 rounding and no cast kernel after it (9 a step for DCNv2)."""
    if not a.is_cuda:
        return (a.t() @ b).float()
    return torch.mm(a.t(), b, out_dtype=torch.float32)


def column_sums(t: torch.Tensor) -> torch.Tensor:
    """t [M, N]'s column sums in fp32 [N]; a 16-bit t on CUDA as a product with a column of ones (fp32
    accumulation): torch's dim-0 sum took 63 us for [65,536, 1,024] bf16 alone, the product 38
    (benchmarks/NOTES.md)."""
    if not t.is_cuda or t.dtype == torch.float32:
        return t.sum(0, dtype=torch.float32)
    return weight_grad(torch.ones(t.shape[0], 1, dtype=t.dtype, device=t.device), t)[0]


class _Fp8Matmul(torch.autograd.Function):
    """y = x W^T + b with fp8 forward and input-gradient products (module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, options):
        # options: (grad dtype, row scales, fast accumulation, fp8 forward, fp8 dgrad), constants
        x = x.to(torch.bfloat16)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.options = bias is not None, options
        _, rowwise, fast, fp8_forward, _ = options
        if fp8_forward:
            return _scaled(x, E4M3, weight, rowwise, fast, bias)
        bias = None if bias is None else bias.to(torch.bfloat16)
        return torch.nn.functional.linear(x, weight.to(torch.bfloat16), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.to(torch.bfloat16).contiguous()  # [M, N]
        grad_dtype, rowwise, fast, _, fp8_dgrad = ctx.options
        if fp8_dgrad:  # W^T contiguous [K, N]: its rows are the input columns, one scale each
            grad_x = _scaled(grad, grad_dtype, weight.t().contiguous(), rowwise, fast)
        else:
            grad_x = grad @ weight.to(torch.bfloat16)
        grad_w = weight_grad(grad, x)  # bf16 tensor cores, as autocast's Linear does
        # a product, not a sum that inductor fuses into the quantization above: 317 -> 164 + 60 us a
        # step for DCNv2's deep layers on an H200 (benchmarks/NOTES.md)
        grad_b = column_sums(grad) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class Fp8Linear(nn.Linear):
    """`nn.Linear` whose two large products run in fp8 (module doc); same parameters and keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 **options):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.set_options(**options)

    def set_options(self, grad_dtype: torch.dtype = E5M2, rowwise: bool = True, fast_accum: bool = False,
                    fp8_forward: bool = True, fp8_dgrad: bool = True) -> None:
        """Formats and which of the two products run in fp8 (module doc)."""
        self.grad_dtype, self.rowwise, self.fast_accum = grad_dtype, rowwise, fast_accum
        self.fp8_forward, self.fp8_dgrad = fp8_forward, fp8_dgrad

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "Fp8Linear":
        """The same layer (its very parameters, not copies) computing in fp8 (`set_options`)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.set_options(**options)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        options = (self.grad_dtype, self.rowwise, self.fast_accum, self.fp8_forward, self.fp8_dgrad)
        out = _Fp8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self.bias, options)
        if not torch.is_autocast_enabled(x.device.type):  # as a plain Linear: the input's dtype out
            out = out.to(x.dtype)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        products = "+".join(p for p, on in (("forward", self.fp8_forward), ("dgrad", self.fp8_dgrad)) if on)
        return f"{super().extra_repr()}, fp8 {products or 'none'}: e4m3 x " \
               f"{str(self.grad_dtype).split('_')[-1]} grads, {'row' if self.rowwise else 'tensor'} scales" \
               f"{', fast accumulation' if self.fast_accum else ''}"


def check_fp8_device(device: torch.device) -> None:
    """UserError unless `device` is a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)."""
    if device.type != "cuda":
        raise UserError(f"--precision fp8 needs a CUDA GPU of compute capability 8.9 or newer; this run is on {device}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UserError(f"--precision fp8 needs compute capability 8.9 or newer (Ada, Hopper); "
                        f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
