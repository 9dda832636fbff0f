"""`FusedDotInteraction`: DLRM's pairwise dot products in one Triton kernel each way.

Same function as `ctrflow.models.layers.DotInteraction` ([B, F, D] -> [B, F(F-1)/2], pairs i < j in
row-major order). The plain version's `gram[:, rows, cols]` costs a batched matmul plus an
index-put with accumulation in backward (several ms at batch 65,536); here each sample's Gram matrix
lives only in registers: forward reads x once and writes the pairs, backward reads x and the pair
gradients once and writes dx = (G + G^T) x.
"""

from __future__ import annotations

import torch
from torch import nn

from ctrflow.embedding.fused import ops

if ops.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _pair_index(F: tl.constexpr, FP: tl.constexpr):
        i = tl.arange(0, FP)[:, None]
        j = tl.arange(0, FP)[None, :]
        pos = i * (2 * F - i - 1) // 2 + (j - i - 1)  # row-major index of pair (i, j), i < j
        return pos, (i < j) & (j < F)

    @triton.jit
    def dot_pairs_kernel(x_ptr, out_ptr, batch, F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr,
                         PAIRS: tl.constexpr, SAMPLES: tl.constexpr, IEEE: tl.constexpr):
        """out[b] = upper triangle (i < j) of x[b] x[b]^T for SAMPLES samples b."""
        feats = tl.arange(0, FP)
        cols = tl.arange(0, D)
        pos, valid = _pair_index(F, FP)
        for s in range(SAMPLES):
            b = tl.program_id(0).to(tl.int64) * SAMPLES + s
            if b < batch:
                x = tl.load(x_ptr + b * F * D + feats[:, None] * D + cols[None, :], mask=feats[:, None] < F,
                            other=0.0)
                if IEEE:
                    gram = tl.dot(x, tl.trans(x), input_precision="ieee")
                else:
                    gram = tl.dot(x, tl.trans(x))
                tl.store(out_ptr + b * PAIRS + pos, gram.to(out_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def dot_pairs_backward_kernel(x_ptr, grad_ptr, dx_ptr, grad_stride, batch, F: tl.constexpr,
                                  FP: tl.constexpr, D: tl.constexpr, PAIRS: tl.constexpr, SAMPLES: tl.constexpr,
                                  IEEE: tl.constexpr):
        """dx[b] = (G + G^T) x[b], G [F, F] the pair gradients placed at (i, j), i < j (rows of the
        pair gradient `grad_stride` apart: it is often a slice of the next layer's input gradient)."""
        feats = tl.arange(0, FP)
        cols = tl.arange(0, D)
        pos, valid = _pair_index(F, FP)
        for s in range(SAMPLES):
            b = tl.program_id(0).to(tl.int64) * SAMPLES + s
            if b < batch:
                x = tl.load(x_ptr + b * F * D + feats[:, None] * D + cols[None, :], mask=feats[:, None] < F,
                            other=0.0)
                g = tl.load(grad_ptr + b * grad_stride + pos, mask=valid, other=0.0).to(tl.float32)
                sym = (g + tl.trans(g)).to(x.dtype)  # one nonzero term per entry: exact in bf16
                if IEEE:
                    dx = tl.dot(sym, x, input_precision="ieee")
                else:
                    dx = tl.dot(sym, x)
                tl.store(dx_ptr + b * F * D + feats[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                         mask=feats[:, None] < F)


_SAMPLES = 8


def _launch(kernel, batch: int, *tensors, features: int, dim: int, ieee: bool) -> None:
    kernel[(triton.cdiv(batch, _SAMPLES),)](
        *tensors, batch, F=features, FP=max(16, triton.next_power_of_2(features)), D=dim,
        PAIRS=features * (features - 1) // 2, SAMPLES=_SAMPLES, IEEE=ieee, num_warps=4)


class _DotPairs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor):
        x = x.contiguous()
        batch, features, dim = x.shape
        out = torch.empty(batch, features * (features - 1) // 2, dtype=x.dtype, device=x.device)
        _launch(dot_pairs_kernel, batch, x, out, features=features, dim=dim, ieee=x.dtype == torch.float32)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        batch, features, dim = x.shape
        dx = torch.empty_like(x)
        if grad.stride(1) != 1:
            grad = grad.contiguous()
        _launch(dot_pairs_backward_kernel, batch, x, grad, dx, grad.stride(0), features=features, dim=dim,
                ieee=x.dtype == torch.float32)
        return dx


class FusedDotInteraction(nn.Module):
    """Drop-in for `DotInteraction(num_features)`: [B, F, D] -> [B, F(F-1)/2] (torch path off CUDA).

    Needs D a power of two (a Triton block); other shapes take the torch path.
    """

    def __init__(self, num_features: int):
        super().__init__()
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.out_features = rows.numel()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(features.device.type) and features.is_floating_point():
            features = features.to(torch.get_autocast_dtype(features.device.type))  # as bmm under autocast
        dim = features.shape[2]
        if ops.uses_kernels(features) and dim >= 16 and dim & (dim - 1) == 0:
            return _DotPairs.apply(features)
        gram = torch.bmm(features, features.transpose(1, 2))  # [B, F, F]
        return gram[:, self.rows, self.cols]
