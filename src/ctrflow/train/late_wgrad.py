"""Weight gradients computed after backward, while the tables' gradient exchange travels (N GPUs).

Autograd runs each Linear's input gradient and weight gradient together, layer by layer, so on
several GPUs the fused sharded tables' gradient all-to-all starts only after every weight gradient
of the layers above the embeddings (DLRM's top MLP: ~0.5 ms of products at batch 65,536), and what
is left of backward is too short to hide it. `LateLinear`'s backward returns only the input gradient
and keeps (input, output gradient); `finish_weight_grads` then computes the weight and bias gradients
after `loss.backward()`, when the exchange already travels. Same products in the same dtypes as
autograd's (bf16 under autocast, accumulated into fp32 `.grad`): only their order changes.

Only where the step itself averages the dense gradients after backward (`DenseAverage`, the graphed
step on N processes): DDP's hooks would wait for gradients during backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _LateLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        kind = x.device.type
        # the product in autocast's dtype, as nn.Linear's under autocast; the cast weight is kept
        # for the input gradient as autograd keeps it
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
        xc, wc = x.to(dtype), weight.to(dtype)
        with torch.autocast(kind, enabled=False):
            out = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.layer = layer
        return out

    @staticmethod
    def backward(ctx, grad):
        xc, wc = ctx.saved_tensors
        ctx.layer.pending.append((xc, grad))
        dx = grad.matmul(wc) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class LateLinear(nn.Linear):
    """An `nn.Linear` (same parameters) whose weight and bias gradients wait for `finish_weight_grads`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output gradient) per backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LateLinearFunction.apply(x, self.weight, self.bias, self)

    @torch.no_grad()
    def finish(self) -> None:
        """Add the kept backward passes' weight and bias gradients to `.grad`."""
        for x, grad in self.pending:
            x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
            _accumulate(self.weight, g2.t().mm(x2))  # [out, in]
            if self.bias is not None:
                _accumulate(self.bias, g2.sum(0))
        self.pending.clear()


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


def defer_weight_grads(model: nn.Module) -> int:
    """Replace, in place, every plain `nn.Linear` of `model` by a `LateLinear` holding the same
    parameters; returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        late = LateLinear(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        late.weight, late.bias = linear.weight, linear.bias
        setattr(parent, leaf, late)
    return len(targets)


def finish_weight_grads(model: nn.Module) -> None:
    """The weight gradients `LateLinear` layers kept, now (no-op for a model without them)."""
    for module in model.modules():
        if isinstance(module, LateLinear) and module.pending:
            module.finish()
