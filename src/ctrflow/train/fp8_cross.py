"""`Fp8CrossNet`: DCNv2's cross layers in fp8 with their elementwise work in hand-written row kernels.

x_{l+1} = x0 * h_l + x_l, h_l = U_l (V_l x_l) + b_l on [M, N] rows (N = 3456, rank r = 512 for MLPerf).
Under `apply_fp8` every product of a layer is fp8 (`ctrflow.train.fp8`), and each product's wide operand
needs an fp8 copy with row scales. Inductor fuses those quantizations into the row producers as
looped reductions that read the row two or three times (+1.8 ms per step of 65,536, ~1.2 ms over the
byte floor: benchmarks/NOTES.md, "DCNv2, session 2"). Here one Triton program owns whole rows
(`fp8_kernels.py`), so each [M, N] tensor is read once per pass (P = one bf16 pass over [M, N]):

- forward: x0's e4m3 copy (1.5 P); per layer y = x0 * h + x with
  its e4m3 copy and row scales in the same pass (4.5 P; 3.5 for the first layer, x = x0). The last
  layer's copy feeds the next Linear, which the net then computes itself (`absorb`: DCNv2's first deep
  layer) rather than quantize x_L again in the next compiled graph (inductor: a looped row reduction,
  0.36 ms at M 65,536);
- backward, per layer top down: one pass G_{l+1} = G_L + D_{L-1} + ... + D_{l+1} (D_k: the down
  layer's input gradient, kept), dh = G_{l+1} * x0 (bf16 for dU, e5m2 + row scales for dz = dh U) and
  the bias gradient's column sums (3.5 + P per D read); then one pass for the whole x0 gradient,
  dx0 = sum_l G_{l+1} * h_l + G_1 + D_0 (2L + 2 P), instead of an accumulator read and written per layer.

For L = 3: 36 P against ~40 for the same algebra with an accumulator, the products as in `Fp8Linear`
(fp8 forward and input-gradient, bf16 weight gradients). Measured on one H200 (M 65,536): the kernels
run at the device-copy rate; the cross net's forward + backward 9.10 ms against 9.83 for the same
`Fp8Linear` layers compiled by inductor (benchmarks/fp8_cross.py). Same parameters and state-dict keys as the
`LowRankCrossNet` it replaces; its `Fp8Linear` layers stay, and run the plain formula wherever this
one does not apply (inputs not 2-D, > 4 layers, rows wider than 8192). The kernels need CUDA and
Triton; elsewhere (the CPU: `_scaled_mm` runs there too) the same algebra runs in torch (`*_reference`).
The cross net runs eagerly between two compiled graphs (`torch.compiler.disable`: Triton launches).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ctrflow.models.layers import LowRankCrossNet
from ctrflow.train.fp8 import E4M3, Fp8Linear, quantize_rows

try:  # the kernel compiler exists only where CUDA does
    import triton

    from ctrflow.train import fp8_kernels as K
except ImportError:  # pragma: no cover - depends on the machine
    triton = K = None

BF16 = torch.bfloat16
MAX_LAYERS, MAX_WIDTH = 4, 8192
# launch shape: values per program (ROWS x BLOCK_N), warps, persistent dh programs per SM (benchmarks/fp8_cross.py)
LAUNCH = {"tile": 4096, "warps": 8, "quantize_warps": 4, "dh_per_sm": 4, "dh_warps": 8}


def _kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and K is not None and t.shape[-1] <= MAX_WIDTH


def _shape(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, warps) for rows of width n."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, LAUNCH["tile"] // block_n)
    return block_n, rows, LAUNCH["warps"] if rows * block_n >= 2048 else 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`ctrflow.train.fp8.quantize_rows` of a 2-D tensor, in one kernel on CUDA; x may be strided (a
    weight's `.t()`: read in place rather than copied contiguous first, 7 copies a step for DCNv2)."""
    if not _kernels(x):
        return quantize_rows(x, dtype)
    (m, n), (block_n, rows, warps) = x.shape, _shape(x.shape[1])
    q = torch.empty(m, n, dtype=dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    K.quantize_rows_kernel[(triton.cdiv(m, rows),)](x, q, scale, m, n, x.stride(0), x.stride(1),
                                                    TOP=torch.finfo(dtype).max, ROWS=rows, BLOCK_N=block_n,
                                                    num_warps=min(warps, LAUNCH["quantize_warps"]))
    return q, scale


def forward_reference(x0, h, x, quant: bool):
    """(y, e4m3 copy, row scales) — copy and scales None unless `quant` — as `cross_forward_kernel`."""
    y = (x0.float() * h.float() + x.float()).to(BF16)
    return (y, *quantize_rows(y, E4M3)) if quant else (y, None, None)


def cross_forward(x0: torch.Tensor, h: torch.Tensor, x: torch.Tensor, quant: bool):
    """y = x0 * h + x [M, N] bf16 and (if `quant`) its e4m3 copy and row scales [M, 1], in one pass."""
    if not _kernels(x0):
        return forward_reference(x0, h, x, quant)
    (m, n), (block_n, rows, warps) = x0.shape, _shape(x0.shape[1])
    y = torch.empty_like(x0)
    q = torch.empty(m, n, dtype=E4M3, device=x0.device) if quant else y
    scale = torch.empty(m, 1, dtype=torch.float32, device=x0.device) if quant else y
    K.cross_forward_kernel[(triton.cdiv(m, rows),)](
        x0, h, x, y, q, scale, m, n, TOP=torch.finfo(E4M3).max, X_IS_X0=x is x0, QUANT=quant, ROWS=rows,
        BLOCK_N=block_n, num_warps=warps)
    return (y, q, scale) if quant else (y, None, None)


def dh_reference(g, ds, x0, dtype):
    """(dh, its `dtype` copy, row scales, bias gradient fp32 [N]) as `cross_dh_kernel`."""
    g = g.float()
    for d in ds:
        g = (g + d.float()).to(BF16).float()
    dh = (g * x0.float()).to(BF16)
    return (dh, *quantize_rows(dh, dtype), dh.float().sum(0))


def cross_dh(g: torch.Tensor, ds: list[torch.Tensor], x0: torch.Tensor, dtype: torch.dtype):
    """dh = (g + ds[0] + ds[1] + ...) * x0 [M, N] bf16, its `dtype` copy with row scales, and its
    column sums (the bias gradient, fp32 [N]) in one pass; at most 3 `ds`."""
    if not _kernels(x0):
        return dh_reference(g, ds, x0, dtype)
    (m, n), (block_n, rows, _) = x0.shape, _shape(x0.shape[1])
    dh = torch.empty_like(x0)
    q = torch.empty(m, n, dtype=dtype, device=x0.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x0.device)
    programs = min(triton.cdiv(m, rows), _sm_count(x0.device.index or 0) * LAUNCH["dh_per_sm"])
    parts = torch.empty(programs, n, dtype=torch.float32, device=x0.device)  # every row written
    d = [*ds, g, g, g][:3]
    iters = triton.cdiv(triton.cdiv(m, rows), programs)
    K.cross_dh_kernel[(programs,)](g, *d, x0, dh, q, scale, parts, m, n, programs, iters, TOP=torch.finfo(dtype).max,
                                   ND=len(ds), ROWS=rows, BLOCK_N=block_n, num_warps=LAUNCH["dh_warps"])
    return dh, q, scale, parts.sum(0)


def dx0_reference(g, ds, hs):
    """dx0 as `cross_dx0_kernel`: ds, hs top down (D_{L-1}, ..., D_0; h_{L-1}, ..., h_0)."""
    g, acc = g.float(), torch.zeros_like(g, dtype=torch.float32)
    for d, h in zip(ds, hs):
        acc = acc + g * h.float()
        g = (g + d.float()).to(BF16).float()
    return (acc + g).to(BF16)


def cross_dx0(g: torch.Tensor, ds: list[torch.Tensor], hs: list[torch.Tensor]) -> torch.Tensor:
    """x0's whole gradient [M, N] bf16 from G_L and every layer's D and h, top down, in one pass."""
    if not _kernels(g):
        return dx0_reference(g, ds, hs)
    (m, n), (block_n, rows, warps) = g.shape, _shape(g.shape[1])
    out = torch.empty_like(g)
    pad = [g] * (MAX_LAYERS - len(ds))
    K.cross_dx0_kernel[(triton.cdiv(m, rows),)](g, *ds, *pad, *hs, *pad, out, m, n, L=len(ds), ROWS=rows,
                                                BLOCK_N=block_n, num_warps=warps)
    return out


def _product(aq, a_scale, b_rows, fast: bool, bias=None) -> torch.Tensor:
    """a @ b_rows^T [M, N] bf16 from a's fp8 copy and row scales; b_rows [N, K] quantized here (e4m3)."""
    bq, b_scale = quantize(b_rows, E4M3)
    # bq.t(): [K, N] column-major, the layout _scaled_mm wants for B; its row scales -> [1, N]
    return torch._scaled_mm(aq, bq.t(), scale_a=a_scale, scale_b=b_scale.t(),
                            bias=None if bias is None else bias.to(BF16), out_dtype=BF16, use_fast_accum=fast)


class _Fp8Cross(torch.autograd.Function):
    """x_L from x0 [M, N] and the layers' V_l [r, N], U_l [N, r], b_l [N]; with `absorbs`, the next
    Linear's output x_L W^T + c from its W [K, N], c [K] too (module doc)."""

    @staticmethod
    def forward(ctx, x0, options, *params):
        grad_dtype, fast, absorbs = options  # constants
        layers = (len(params) - 2 * absorbs) // 3
        downs, ups, biases = params[:layers], params[layers:2 * layers], params[2 * layers:3 * layers]
        ctx.x0_dtype = x0.dtype
        x0 = x0.to(BF16).contiguous()
        xq, x_scale = quantize(x0, E4M3)
        x, saved = x0, []
        for i, (down, up, bias) in enumerate(zip(downs, ups, biases)):
            z = _product(xq, x_scale, down, fast)  # [M, r]
            h = _product(*quantize(z, E4M3), up, fast, bias)  # [M, N]
            y, xq, x_scale = cross_forward(x0, h, x, quant=absorbs or i < layers - 1)
            saved += [x, z, h]
            x = y
        ctx.layers, ctx.options = layers, options
        if absorbs:  # the next Linear from x_L's e4m3 copy, made in the last pass above
            weight, bias = params[3 * layers:]
            ctx.save_for_backward(x0, *downs, *ups, *saved, x, weight)
            return _product(xq, x_scale, weight, fast, bias)  # [M, K]
        ctx.save_for_backward(x0, *downs, *ups, *saved)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad_dtype, fast, absorbs = ctx.options
        layers = ctx.layers
        x0, *rest = ctx.saved_tensors
        downs, ups, saved = rest[:layers], rest[layers:2 * layers], rest[2 * layers:5 * layers]
        d_down, d_up, d_bias, ds, d_next = [None] * layers, [None] * layers, [None] * layers, [], ()
        g = grad.to(BF16).contiguous()  # G_L = dL/dx_L, or the next Linear's output gradient [M, K]
        if absorbs:  # as Fp8Linear's backward
            x_last, weight = rest[5 * layers:]
            d_next = ((g.t() @ x_last).float(), g.sum(0, dtype=torch.float32))
            g = _product(*quantize(g, grad_dtype), weight.t(), fast)  # G_L [M, N]
        for i in reversed(range(layers)):
            x, z, _ = saved[3 * i:3 * i + 3]
            dh, dh_q, dh_scale, d_bias[i] = cross_dh(g, ds, x0, grad_dtype)
            dz = _product(dh_q, dh_scale, ups[i].t(), fast)  # dh U: [M, r]
            d_up[i] = (dh.t() @ z).float()  # bf16 tensor cores, as Fp8Linear's dW
            ds.append(_product(*quantize(dz, grad_dtype), downs[i].t(), fast))  # D_i = dz V
            d_down[i] = (dz.t() @ x).float()
        dx0 = cross_dx0(g, ds, [saved[3 * i + 2] for i in reversed(range(layers))])
        return (dx0.to(ctx.x0_dtype), None, *d_down, *d_up, *d_bias, *d_next)


class AbsorbedFp8Linear(Fp8Linear):
    """The `Fp8Linear` right after an `Fp8CrossNet` (DCNv2's first deep layer), computed by the cross
    net from the e4m3 copy of x_L its last pass makes (instead of a quantization pass of its own over
    [M, N] in the next graph: 0.36 ms at M 65,536). Same parameters and keys; its forward passes its
    input through, as that input is already this layer's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Fp8CrossNet(LowRankCrossNet):
    """`LowRankCrossNet` over `Fp8Linear` layers (same parameters and keys) computed by `_Fp8Cross`
    where it applies (module doc), by the layers' own fp8 formula elsewhere; with `absorb`, the next
    Linear layer too."""

    absorbed: tuple = ()  # (AbsorbedFp8Linear,) once `absorb` took one: a reference, not a submodule

    @classmethod
    def from_cross(cls, cross: LowRankCrossNet) -> "Fp8CrossNet":
        """The same cross layers (their very modules and parameters), computed here."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.down, new.up, new.out_features = cross.down, cross.up, cross.out_features
        return new

    @staticmethod
    def suits(cross: LowRankCrossNet) -> bool:
        """Whether `cross`'s layers are all `Fp8Linear`s with both products in fp8, row scales and one
        gradient format and accumulation, biased up layers, 1 to 4 of them, rows <= 8192 wide."""
        layers = [*cross.down, *cross.up]
        if not layers or not all(isinstance(m, Fp8Linear) for m in layers):
            return False
        same = {(m.grad_dtype, m.fast_accum) for m in layers}
        return (len(same) == 1 and all(m.fp8_forward and m.fp8_dgrad and m.rowwise for m in layers)
                and all(m.bias is not None for m in cross.up) and all(m.bias is None for m in cross.down)
                and len(cross.down) <= MAX_LAYERS and cross.out_features <= MAX_WIDTH)

    def options(self) -> tuple[torch.dtype, bool]:
        """(gradient fp8 format, fast accumulation) of the layers."""
        return self.down[0].grad_dtype, self.down[0].fast_accum

    def absorb(self, linear: nn.Module) -> AbsorbedFp8Linear | None:
        """The layer to put in `linear`'s place if this net can compute `linear` (an `Fp8Linear` on
        x_L with both products in fp8, row scales, a bias, this net's options), else None."""
        fits = (type(linear) is Fp8Linear and linear.in_features == self.out_features and linear.bias is not None
                and linear.fp8_forward and linear.fp8_dgrad and linear.rowwise
                and (linear.grad_dtype, linear.fast_accum) == self.options())
        if not fits:
            return None
        absorbed = AbsorbedFp8Linear.from_linear(linear, grad_dtype=linear.grad_dtype, fast_accum=linear.fast_accum)
        self.absorbed = (absorbed,)
        return absorbed

    @torch.compiler.disable  # Triton launches stay out of an enclosing compiled graph (a graph break)
    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        if x0.dim() != 2 or x0.shape[0] == 0 or not self.suits(self):
            out = super().forward(x0)
            return Fp8Linear.forward(self.absorbed[0], out) if self.absorbed else out
        extra = (self.absorbed[0].weight, self.absorbed[0].bias) if self.absorbed else ()
        with torch.autocast(x0.device.type, enabled=False):
            out = _Fp8Cross.apply(x0, (*self.options(), bool(self.absorbed)), *(m.weight for m in self.down),
                                  *(m.weight for m in self.up), *(m.bias for m in self.up), *extra)
        # as Fp8Linear: bf16 under autocast, the input's dtype without it
        return out if torch.is_autocast_enabled(x0.device.type) else out.to(x0.dtype)
