"""Alignment of dense layers for the tensor cores: a Linear whose input width is not a multiple of 8
(DLRM: 13 dense features, 128 + 351 = 479 into the top MLP) makes bf16 rows misaligned for 16-byte
loads, and cuBLAS then falls back to slow kernels in forward and in both backward products.
`align_linear_inputs` pads such inputs with zero columns (the MLPerf DLRM pads 479 to 480); the
function computed is the same, and the padded weight columns get zero gradients, so they stay zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AlignedLinear(nn.Module):
    """`linear` with its input zero-padded to a multiple of `multiple` columns: same outputs."""

    def __init__(self, linear: nn.Linear, multiple: int = 8):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pad = -linear.in_features % multiple
        weight = F.pad(linear.weight.detach(), (0, self.pad))  # [out, in + pad], new columns zero
        self.weight = nn.Parameter(weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.pad(x, (0, self.pad)), self.weight, self.bias)

    def to_linear(self) -> nn.Linear:
        """The plain layer again (for checkpoints and export)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight[:, :self.in_features])
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


def align_linear_inputs(model: nn.Module, multiple: int = 8) -> int:
    """Replace, in place, every `nn.Linear` of `model` whose input width is not a multiple of
    `multiple` by an `AlignedLinear`; returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and m.in_features % multiple]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, AlignedLinear(linear, multiple))
    return len(targets)
