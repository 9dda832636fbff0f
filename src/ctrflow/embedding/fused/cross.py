"""`FusedCrossNet`: DCNv2's low-rank cross layers with their elementwise work inside the products.

Same function and parameters as `ctrflow.models.layers.LowRankCrossNet`:
x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l on [M, N] rows (N = 27 x 128 = 3456 for MLPerf, rank
r = 512). Compiled by inductor, the plain version runs each product on cuBLAS and its elementwise
work in separate kernels: ~31 passes over [M, N] bf16 per step (forward: read h, x0, x, write y;
backward: dh = g * x0, the bias sums, and one kernel summing every g * h into dx0), 2.8-3.1 ms of a
14.1 ms step at M = 65,536 (benchmarks/NOTES.md, "DCNv2, session 2"). Here (`cross_kernels.py`):

- forward, per layer: z = x V^T (cuBLAS, K = N), then one Triton product z U^T whose epilogue adds
  b, stores h and y = x0 * h + x;
- backward, given G = dL/dx_L: one pass dh = G * x0, the bias sums and acc = G * h; then per layer
  (top down) dz = dh U, dU = dh^T z, dV = dz^T x (cuBLAS), and one Triton product dz V whose
  epilogue adds the incoming G (the identity path) and does the next layer down's dh, bias sums and
  acc += G * h; the last one writes dx0 = G_0 + acc.

The [M, N] tensors each layer saves (x, h) are what the plain path saves. Runs under bf16 autocast
on CUDA with Triton, N a multiple of 32 and r of 64; anything else (the CPU, fp32, eval on odd
shapes) takes the plain module's path. `forward_reference`/`backward_reference` are the same
epilogues in torch: the Function's algebra runs (and is tested) on the CPU with them.

Measured on one H200 (benchmarks/NOTES.md, "DCNv2, session 3"): correct (AUC |delta| 6.8-7.4e-4 vs
the plain fp32 path after 100 steps) but **slower**: each Triton program runs its product and its
epilogue back to back, so a fused kernel costs the cuBLAS product plus its epilogue's bytes (forward
0.80-0.93 ms against 0.40 + 0.44 unfused), and the step went 14.1-14.2 -> 14.6-15.1 ms. Winning
needs the epilogue of one tile to overlap the product of the next (warp-specialized persistent
products, which Triton offers on Hopper only through Gluon). Hence opt-in only: the benchmark's
`:cross` paths, `compile_dense(..., fuse_cross=True)`; `ctrflow train` does not use it.
"""

from __future__ import annotations

import torch
from torch import nn

from ctrflow.embedding.fused import ops
from ctrflow.models.layers import LowRankCrossNet

if ops.triton is not None:
    import triton

    from ctrflow.embedding.fused import cross_kernels as K
else:  # pragma: no cover - depends on the machine
    K = None

BF16 = torch.bfloat16


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp32 (the kernels' accumulation), float64 stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def forward_reference(z, up, bias, x0, x):
    """(h, y) as `cross_forward_kernel` computes them, in torch."""
    h = (_wide(z) @ _wide(up).t() + _wide(bias)).to(x0.dtype)
    return h, (_wide(x0) * _wide(h) + _wide(x)).to(x0.dtype)


def backward_reference(dz, down, gin, x0, h, acc, last):
    """(g, dh, db, acc_out) — or dx0 when `last` — as `cross_backward_kernel` computes them, in torch."""
    dtype = gin.dtype
    g = gin if dz is None else (_wide((_wide(dz) @ _wide(down)).to(dtype)) + _wide(gin)).to(dtype)
    acc = torch.zeros_like(_wide(g)) if acc is None else _wide(acc)
    if last:
        return (_wide(g) + acc).to(dtype)
    dh = (_wide(g) * _wide(x0)).to(dtype)
    return g, dh, _wide(dh).sum(0), (acc + _wide(g) * _wide(h)).to(dtype)


def cross_forward(z, up, bias, x0, x):
    """One layer's forward (h, y) on z [M, r], U [N, r], b [N], x0 and x [M, N]: the kernel on CUDA."""
    if not z.is_cuda:
        return forward_reference(z, up, bias, x0, x)
    M, N = x0.shape
    h, y = torch.empty_like(x0), torch.empty_like(x0)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * (N // meta["BLOCK_N"]),)  # noqa: E731
    K.cross_forward_kernel[grid](z, up, bias, x0, x, h, y, M, N, z.shape[1], X_IS_X0=x is x0, BLOCK_K=K.BLOCK_K)
    return h, y


def cross_backward(dz, down, gin, x0, h, acc, last):
    """One backward step (`backward_reference`'s outputs; dz None: no product): the kernel on CUDA."""
    if not gin.is_cuda:
        return backward_reference(dz, down, gin, x0, h, acc, last)
    M, N = gin.shape
    out = torch.empty_like(gin)  # never aliases acc: autotuning reruns the kernel on its inputs
    g = torch.empty_like(gin) if dz is not None and not last else gin
    dh = gin if last else torch.empty_like(gin)
    # column sums in MIN_BLOCK_M-row slots, as many as the tallest tiles cover (cross_backward_kernel)
    slots = triton.cdiv(M, K.MAX_BLOCK_M) * (K.MAX_BLOCK_M // K.MIN_BLOCK_M)
    parts = torch.zeros(1 if last else slots, N, device=gin.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * (N // meta["BLOCK_N"]),)  # noqa: E731
    rank = 0 if dz is None else dz.shape[1]
    K.cross_backward_kernel[grid](
        gin if dz is None else dz, gin if down is None else down, gin, x0, gin if h is None else h,
        gin if acc is None else acc, g, dh, out, parts, M, N, rank, HAS_DOT=dz is not None,
        HAS_ACC=acc is not None, LAST=last, MIN_M=K.MIN_BLOCK_M, BLOCK_K=K.BLOCK_K)
    return out if last else (g, dh, parts.sum(0), out)


class _CrossNet(torch.autograd.Function):
    """x_L from x0 [M, N] and the layers' (V_l [r, N], U_l [N, r], b_l [N]) tensors (module doc)."""

    @staticmethod
    def forward(ctx, x0, *params):
        layers = len(params) // 3
        downs, ups, biases = params[:layers], params[layers:2 * layers], params[2 * layers:]
        x, saved = x0, []
        for down, up, bias in zip(downs, ups, biases):
            z = x @ down.t()  # [M, r]
            h, y = cross_forward(z, up, bias, x0, x)
            saved += [x, z, h]
            x = y
        ctx.layers = layers
        ctx.save_for_backward(x0, *downs, *ups, *saved)
        return x

    @staticmethod
    def backward(ctx, grad):
        layers = ctx.layers
        x0, *rest = ctx.saved_tensors
        downs, ups, saved = rest[:layers], rest[layers:2 * layers], rest[2 * layers:]
        d_down, d_up, d_bias = [None] * layers, [None] * layers, [None] * layers
        g = grad.to(x0.dtype).contiguous()  # dL/dx_L
        g, dh, d_bias[-1], acc = cross_backward(None, None, g, x0, saved[-1], None, last=False)
        for i in reversed(range(layers)):
            x, z, _ = saved[3 * i:3 * i + 3]
            dz = dh @ ups[i]  # [M, r]
            d_up[i] = dh.t() @ z
            d_down[i] = dz.t() @ x
            if i == 0:
                dx0 = cross_backward(dz, downs[0], g, x0, None, acc, last=True)
            else:
                g, dh, d_bias[i - 1], acc = cross_backward(dz, downs[i], g, x0, saved[3 * i - 1], acc, last=False)
        return (dx0, *d_down, *d_up, *d_bias)


def cross_layers(x0: torch.Tensor, downs, ups, biases) -> torch.Tensor:
    """x_L of the cross layers (module doc); x0 and the weights in one dtype, biases fp32."""
    return _CrossNet.apply(x0, *downs, *ups, *biases)


class FusedCrossNet(LowRankCrossNet):
    """Drop-in for `LowRankCrossNet` (same parameters and state-dict keys) running the fused kernels
    under bf16 autocast on CUDA (module doc); the plain path everywhere else."""

    @classmethod
    def from_plain(cls, plain: LowRankCrossNet) -> "FusedCrossNet":
        """The fused twin of a model's cross layers, over the very same parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.down, new.up, new.out_features = plain.down, plain.up, plain.out_features
        return new

    @staticmethod
    def suits(cross: LowRankCrossNet) -> bool:
        """Whether the kernels can ever run these layers: plain Linear layers (not fp8 ones, whose
        quantizations inductor fuses into the plain path), Triton present, N and r tile-sized."""
        plain = (all(type(m) is nn.Linear for m in (*cross.down, *cross.up))
                 and all(m.bias is not None for m in cross.up))
        return (plain and K is not None and len(cross.down) > 0 and K.tile_width(cross.out_features) > 0
                and cross.down[0].out_features % K.BLOCK_K == 0)

    def fusable(self, x0: torch.Tensor) -> bool:
        """Whether `forward` takes the kernels for this input (module doc)."""
        return (self.suits(self) and ops.uses_kernels(x0) and x0.dim() == 2 and x0.shape[0] > 0
                and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == BF16)

    @torch.compiler.disable  # Triton launches stay out of an enclosing compiled graph (a graph break)
    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        if not self.fusable(x0):
            return super().forward(x0)
        with torch.autocast("cuda", enabled=False):
            return cross_layers(x0.to(BF16).contiguous(), [m.weight.to(BF16) for m in self.down],
                                [m.weight.to(BF16) for m in self.up], [m.bias for m in self.up])
