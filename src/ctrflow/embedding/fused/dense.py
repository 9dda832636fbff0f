"""Alignment of dense layers for the tensor cores: a Linear whose input width is not a multiple of 8
(DLRM and DCNv2: 13 dense features into the bottom MLP) makes bf16 rows misaligned for 16-byte
loads, and cuBLAS then falls back to slow kernels in forward and in both backward products.
`AlignedLinear` pads the input and the weight with zero columns for the product only (the MLPerf
DLRM pads 479 to 480 the same way); its parameters stay `nn.Linear`'s, so the function, the
gradients, the optimizer state and the checkpoint keys are those of the plain layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AlignedLinear(nn.Linear):
    """An `nn.Linear` whose product runs on inputs zero-padded to a multiple of `multiple` columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, multiple: int = 8,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.pad = -in_features % multiple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weight's pad columns are zeros built each step (a [out, pad] write): no parameter grows
        return F.linear(F.pad(x, (0, self.pad)), F.pad(self.weight, (0, self.pad)), self.bias)


def align_linear_inputs(model: nn.Module, multiple: int = 8) -> int:
    """Replace, in place, every `nn.Linear` of `model` whose input width is not a multiple of
    `multiple` by an `AlignedLinear` holding the same parameters; returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and m.in_features % multiple]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        aligned = AlignedLinear(linear.in_features, linear.out_features, linear.bias is not None, multiple,
                                device="meta")
        aligned.weight, aligned.bias = linear.weight, linear.bias  # the same Parameter objects
        setattr(parent, leaf, aligned)
    return len(targets)
