"""`Fp8CrossNet`: DCNv2's cross layers in fp8 with their elementwise work in hand-written row kernels.

x_{l+1} = x0 * h_l + x_l, h_l = U_l (V_l x_l) + b_l on [M, N] rows (N = 3456, rank r = 512 for MLPerf).
Under `apply_fp8` every product of a layer is fp8 (`ctrflow.accel.fp8.linear`), and each product's wide operand
needs an fp8 copy with row scales. Inductor fuses those quantizations into the row producers as
looped reductions that read the row two or three times (+1.8 ms per step of 65,536, ~1.2 ms over the
byte floor: benchmarks/NOTES.md, "DCNv2 on one GPU"). Here one Triton program owns whole rows
(`kernels.py`), so each [M, N] tensor is read once per pass (P = one bf16 pass over [M, N]):

- forward: x0's e4m3 copy (1.5 P); per layer y = x0 * h + x with
  its e4m3 copy and row scales in the same pass (4.5 P; 3.5 for the first layer, x = x0). The last
  layer's copy feeds the next Linear, which the net then computes itself (`absorb`: DCNv2's first deep
  layer) rather than quantize x_L again in the next compiled graph (inductor: a looped row reduction,
  0.36 ms at M 65,536);
- backward, per layer top down: one pass G_{l+1} = G_L + D_{L-1} + ... + D_{l+1} (D_k: the down
  layer's input gradient, kept), dh = G_{l+1} * x0 as fp8 copies for dz = dh U (e5m2, row scales) and
  for the fp8 weight gradient dU = dh^T z (batch-major e4m3), and the bias gradient's column sums
  (3 + P per D read: `fp8_wgrad.cross_dh_tiles`); then one pass for the whole x0 gradient,
  dx0 = sum_l G_{l+1} * h_l + G_1 + D_0 (2L + 2 P), instead of an accumulator read and written per layer.

For L = 3: 34.5 P against ~40 for the same algebra with an accumulator, the products as in `Fp8Linear`
(fp8 forward and input-gradient, bf16 weight gradients) except dU in fp8 (`wgrad.py`). Measured on
one H200 (M 65,536): the kernels run at the device-copy rate; the cross net's forward +
backward 9.10 ms against 9.83 for the same `Fp8Linear` layers compiled by inductor
(benchmarks/fp8_cross.py). Same parameters and state-dict keys as the
`LowRankCrossNet` it replaces; its `Fp8Linear` layers stay, and run the plain formula wherever this
one does not apply (inputs not 2-D, > 4 layers, rows wider than 8192). The kernels need CUDA and
Triton; elsewhere (the CPU: `_scaled_mm` runs there too) the same algebra runs in torch (`*_reference`).
The cross net runs eagerly between two compiled graphs (`torch.compiler.disable`: Triton launches).

x0 may come in two parts, DCNv2's dense-arch output and its lookups, which every kernel reads (and
dx0's pass writes) in place: no concatenated copy (2 P, ~0.2 ms). The K = 512 up products run in
`product.py`'s kernel instead of cuBLAS's. The weight-gradient products write fp32 (`weight_grad`: not
rounded to bf16, no cast kernel after). dU is fp8, from batch-major copies (`wgrad.py`), and the weight
gradients run in line by default (`wgrad_beside` off): on a side stream the products slow the tile
kernels beside them more than they gain (benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch
from torch import nn

from ctrflow.models.layers import LowRankCrossNet
from ctrflow.streams import beside, side_stream
from ctrflow.accel.fp8 import product as fp8_product, wgrad as fp8_wgrad
from ctrflow.accel.fp8.linear import E4M3, Fp8Linear, column_sums, quantize_rows, weight_grad
from ctrflow.accel.fp8.wgrad import x0_parts, x0_whole

try:  # the kernel compiler exists only where CUDA does
    import triton

    from ctrflow.accel.fp8 import kernels as K
except ImportError:  # pragma: no cover - depends on the machine
    triton = K = None

BF16 = torch.bfloat16
MAX_LAYERS, MAX_WIDTH = 4, 8192
# launch shape: values per program (ROWS x BLOCK_N), warps (benchmarks/fp8_cross.py)
LAUNCH = {"tile": 4096, "warps": 8, "quantize_warps": 4}


def _kernels(t) -> bool:
    """Whether the row kernels take t (a tensor, or x0 in two parts)."""
    _, rest, lead = x0_parts(t)
    return rest.is_cuda and K is not None and lead + rest.shape[-1] <= MAX_WIDTH


def _shape(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, warps) for rows of width n."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, LAUNCH["tile"] // block_n)
    return block_n, rows, LAUNCH["warps"] if rows * block_n >= 2048 else 4


def quantize(x, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`ctrflow.accel.fp8.linear.quantize_rows` of a 2-D tensor (or x0 in two parts), in one kernel on CUDA;
    x may be strided (a weight's `.t()`: read in place rather than copied contiguous first, 7 copies a
    step for DCNv2)."""
    if not _kernels(x):
        return quantize_rows(x0_whole(x), dtype)
    first, rest, lead = x0_parts(x)
    m, n = rest.shape[0], lead + rest.shape[1]
    block_n, rows, warps = _shape(n)
    q = torch.empty(m, n, dtype=dtype, device=rest.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=rest.device)
    K.quantize_rows_kernel[(triton.cdiv(m, rows),)](first, rest, q, scale, m, n, first.stride(0), first.stride(1),
                                                    TOP=torch.finfo(dtype).max, LEAD=lead, ROWS=rows,
                                                    BLOCK_N=block_n, num_warps=min(warps, LAUNCH["quantize_warps"]))
    return q, scale


def forward_reference(x0, h, x, quant: bool):
    """(y, e4m3 copy, row scales) — copy and scales None unless `quant` — as `cross_forward_kernel`."""
    x0, x = x0_whole(x0), x0_whole(x)
    y = (x0.float() * h.float() + x.float()).to(BF16)
    return (y, *quantize_rows(y, E4M3)) if quant else (y, None, None)


def cross_forward(x0, h: torch.Tensor, x, quant: bool):
    """y = x0 * h + x [M, N] bf16 and (if `quant`) its e4m3 copy and row scales [M, 1], in one pass;
    x0 one tensor or two parts (`x0_parts`), x a tensor or x0 itself."""
    if not _kernels(x0):
        return forward_reference(x0, h, x, quant)
    first, rest, lead = x0_parts(x0)
    (m, n), (block_n, rows, warps) = h.shape, _shape(h.shape[1])
    y = torch.empty_like(h)
    q = torch.empty(m, n, dtype=E4M3, device=h.device) if quant else y
    scale = torch.empty(m, 1, dtype=torch.float32, device=h.device) if quant else y
    K.cross_forward_kernel[(triton.cdiv(m, rows),)](
        first, rest, h, rest if x is x0 else x, y, q, scale, m, n, TOP=torch.finfo(E4M3).max, LEAD=lead,
        X_IS_X0=x is x0, QUANT=quant, ROWS=rows, BLOCK_N=block_n, num_warps=warps)
    return (y, q, scale) if quant else (y, None, None)


def dx0_reference(g, ds, hs):
    """dx0 as `cross_dx0_kernel`: ds, hs top down (D_{L-1}, ..., D_0; h_{L-1}, ..., h_0)."""
    g, acc = g.float(), torch.zeros_like(g, dtype=torch.float32)
    for d, h in zip(ds, hs):
        acc = acc + g * h.float()
        g = (g + d.float()).to(BF16).float()
    return (acc + g).to(BF16)


def cross_dx0(g: torch.Tensor, ds: list[torch.Tensor], hs: list[torch.Tensor], lead: int = 0):
    """x0's whole gradient [M, N] bf16 from G_L and every layer's D and h, top down, in one pass; with
    `lead`, in two parts as x0 came (`x0_parts`): [M, lead] and [M, N - lead]."""
    if not _kernels(g):
        dx0 = dx0_reference(g, ds, hs)
        return dx0.split([lead, g.shape[1] - lead], dim=1) if lead else dx0
    (m, n), (block_n, rows, warps) = g.shape, _shape(g.shape[1])
    out = torch.empty(m, lead or n, dtype=BF16, device=g.device)
    rest = torch.empty(m, n - lead, dtype=BF16, device=g.device) if lead else out
    pad = [g] * (MAX_LAYERS - len(ds))
    K.cross_dx0_kernel[(triton.cdiv(m, rows),)](g, *ds, *pad, *hs, *pad, out, rest, m, n, LEAD=lead, L=len(ds),
                                                ROWS=rows, BLOCK_N=block_n, num_warps=warps)
    return (out, rest) if lead else out


def _product(aq, a_scale, b_rows, fast: bool, bias=None, amax: bool = False):
    """a @ b_rows^T [M, N] bf16 from a's fp8 copy and row scales; b_rows [N, K] quantized here (e4m3).
    With `amax`, (product, its rows' largest |value| fp32 [M]): the Triton kernel emits them at any K."""
    bq, b_scale = quantize(b_rows, E4M3)
    bias = None if bias is None else bias.to(BF16)
    if fp8_product.suits(aq, bq, fast, max_k=None if amax else fp8_product.MAX_K):  # the rank-r up products
        top = torch.zeros(aq.shape[0], dtype=torch.float32, device=aq.device) if amax else None
        out = fp8_product.scaled_product(aq, a_scale, bq, b_scale, bias, top)
        return (out, top) if amax else out
    # bq.t(): [K, N] column-major, the layout _scaled_mm wants for B; its row scales -> [1, N]
    out = torch._scaled_mm(aq, bq.t(), scale_a=a_scale, scale_b=b_scale.t(), bias=bias, out_dtype=BF16,
                           use_fast_accum=fast)
    return (out, fp8_wgrad.row_amax(out)) if amax else out


class _Fp8Cross(torch.autograd.Function):
    """x_L from x0 [M, N] (or its parts lead [M, k], rest [M, N - k]; lead None: rest is x0) and the
    layers' V_l [r, N], U_l [N, r], b_l [N]; with `absorbs`, the next Linear's output x_L W^T + c from
    its W [K, N], c [K] too (module doc)."""

    @staticmethod
    def forward(ctx, lead, rest, options, *params):
        grad_dtype, fast, absorbs, _ = options  # constants
        layers = (len(params) - 2 * absorbs) // 3
        downs, ups, biases = params[:layers], params[layers:2 * layers], params[2 * layers:3 * layers]
        ctx.x0_dtypes = [None if t is None else t.dtype for t in (lead, rest)]
        x0s = [t.to(BF16).contiguous() for t in (lead, rest) if t is not None]
        x0 = x0s[0] if lead is None else tuple(x0s)
        xq, x_scale = quantize(x0, E4M3)
        x, saved = x0, [x_scale]  # x0's row scales: its rows' amax bound dh (wgrad.py)
        for i, (down, up, bias) in enumerate(zip(downs, ups, biases)):
            zq, z_scale = quantize(_product(xq, x_scale, down, fast), E4M3)  # z [M, r]
            h = _product(zq, z_scale, up, fast, bias)  # [M, N]
            y, xq, x_scale = cross_forward(x0, h, x, quant=absorbs or i < layers - 1)
            saved += [None if x is x0 else x, zq, z_scale, h]  # the first layer's x is x0, saved apart
            x = y
        ctx.layers, ctx.options = layers, options
        if absorbs:  # the next Linear from x_L's e4m3 copy, made in the last pass above
            weight, bias = params[3 * layers:]
            ctx.save_for_backward(*x0s, *downs, *ups, *saved, x, weight)
            return _product(xq, x_scale, weight, fast, bias)  # [M, K]
        ctx.save_for_backward(*x0s, *downs, *ups, *saved)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad_dtype, fast, absorbs, use_side = ctx.options
        layers = ctx.layers
        parts = 2 if ctx.x0_dtypes[0] is not None else 1
        x0s, rest = ctx.saved_tensors[:parts], ctx.saved_tensors[parts:]
        x0 = x0s[0] if parts == 1 else x0s
        downs, ups = rest[:layers], rest[layers:2 * layers]
        x0_scale, saved = rest[2 * layers], rest[2 * layers + 1:6 * layers + 1]
        d_down, d_up, d_bias, ds, d_next = [None] * layers, [None] * layers, [None] * layers, [], ()
        g = grad.to(BF16).contiguous()  # G_L = dL/dx_L, or the next Linear's output gradient [M, K]
        side = side_stream(g.device, "fp8_cross") if use_side else None
        if absorbs:  # as Fp8Linear's backward
            x_last, weight = rest[6 * layers + 1:]
            with beside(side, g, x_last):
                d_next = (weight_grad(g, x_last), column_sums(g))
            g, g_amax = _product(*quantize(g, grad_dtype), weight.t(), fast, amax=True)  # G_L [M, N]
        else:
            g_amax = fp8_wgrad.row_amax(g)
        amaxes, x0_amax = [g_amax], x0_scale * torch.finfo(E4M3).max
        for i in reversed(range(layers)):
            x, zq, z_scale, _ = saved[4 * i:4 * i + 4]
            bound = fp8_wgrad.dh_bounds(amaxes, x0_amax)
            dh_q, dh_scale, dh_t, t_scale, d_bias[i] = fp8_wgrad.cross_dh_tiles(g, ds, x0, grad_dtype, bound,
                                                                                z_scale)
            dz = _product(dh_q, dh_scale, ups[i].t(), fast)  # dh U: [M, r]
            with beside(side, dh_t, t_scale, zq):  # compute-bound, beside the memory-bound row kernels
                d_up[i] = fp8_wgrad.up_weight_grad(dh_t, t_scale, fp8_wgrad.transposed(zq))
            dz_q = quantize(dz, grad_dtype)
            if i > 0:  # D_i = dz V; the layers below bound their dh by its rows' amax
                d, d_amax = _product(*dz_q, downs[i].t(), fast, amax=True)
                amaxes.append(d_amax)
            else:
                d = _product(*dz_q, downs[i].t(), fast)
            ds.append(d)
            xs = [x] if x is not None else x0s  # the first layer's x is x0: its parts
            with beside(side, dz, *xs):
                d_down[i] = torch.cat([weight_grad(dz, t) for t in xs], dim=1) if len(xs) > 1 \
                    else weight_grad(dz, xs[0])
        dx0 = cross_dx0(g, ds, [saved[4 * i + 3] for i in reversed(range(layers))], x0_parts(x0)[2])
        if side is not None:  # made on the side stream, read by autograd and the optimizer on this one
            torch.cuda.current_stream().wait_stream(side)
            for t in (*d_down, *d_up, *d_next):
                t.record_stream(torch.cuda.current_stream())
        dx0 = [dx0] if parts == 1 else dx0
        d_lead, d_rest = [None] * (2 - parts) + [d.to(dtype) for d, dtype in zip(dx0, ctx.x0_dtypes[2 - parts:])]
        return (d_lead, d_rest, None, *d_down, *d_up, *d_bias, *d_next)


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
    wgrad_beside = False  # the weight gradients' products on a side stream on CUDA (`_Fp8Cross.backward`)

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
    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        """As `LowRankCrossNet.forward`; two parts are read in place, not concatenated."""
        if len(parts) > 2 or any(p.dim() != 2 for p in parts) or parts[0].shape[0] == 0 or not self.suits(self):
            out = super().forward(*parts)
            return Fp8Linear.forward(self.absorbed[0], out) if self.absorbed else out
        lead, rest = (None, *parts) if len(parts) == 1 else parts
        extra = (self.absorbed[0].weight, self.absorbed[0].bias) if self.absorbed else ()
        with torch.autocast(rest.device.type, enabled=False):
            out = _Fp8Cross.apply(lead, rest, (*self.options(), bool(self.absorbed), self.wgrad_beside),
                                  *(m.weight for m in self.down), *(m.weight for m in self.up),
                                  *(m.bias for m in self.up), *extra)
        # as Fp8Linear: bf16 under autocast, the input's dtype without it
        return out if torch.is_autocast_enabled(rest.device.type) else out.to(rest.dtype)
