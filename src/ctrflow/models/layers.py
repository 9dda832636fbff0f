"""Parts shared by the ranking models: MLPs and the feature interactions."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Sequential):
    """Linear layers with ReLU between; `last_activation=False` leaves the output layer linear.

    `dropout` > 0 drops that share of each hidden activation while training. It sits in the
    activation's slot (`ReLU` then `Dropout`, one module), so the Linear layers keep their indices
    and a checkpoint's keys do not depend on it.
    """

    def __init__(self, in_features: int, sizes: Sequence[int], last_activation: bool = True, dropout: float = 0.0):
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[nn.Module] = []
        for i, size in enumerate(sizes):
            layers.append(nn.Linear(in_features, size))
            hidden = i < len(sizes) - 1
            if last_activation or hidden:
                layers.append(nn.Sequential(nn.ReLU(), nn.Dropout(dropout)) if dropout and hidden else nn.ReLU())
            in_features = size
        super().__init__(*layers)
        self.out_features = in_features


def pad_input_columns(linear: nn.Linear, extra: int) -> nn.Linear:
    """`linear` taking `extra` more (zero) input columns: its weight gets `extra` zero columns, so it
    computes the same function and starts from the same numbers; the columns' gradients are zero
    while their inputs are."""
    wider = nn.Linear(linear.in_features + extra, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        wider.weight.zero_()
        wider.weight[:, :linear.in_features].copy_(linear.weight)
        if linear.bias is not None:
            wider.bias.copy_(linear.bias)
    return wider


class DotInteraction(nn.Module):
    """DLRM's interaction: the dense vector [B, D] and the embeddings [B, F-1, D] -> [B, out_features]
    = [dense, the F(F-1)/2 pairwise dot products of the F vectors (i < j, row-major), zeros].
    Without dense features (`dense=False`) it takes the F embeddings alone (`dense` None) and
    returns [pairs, zeros].

    The zero columns pad the width to a multiple of `pad_multiple` (MLPerf pads 128 + 351 = 479 to
    480): the top MLP's bf16 input rows are then 16-byte aligned, which the tensor cores need.
    """

    def __init__(self, num_features: int, dim: int, pad_multiple: int = 8, dense: bool = True):
        super().__init__()
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.num_features, self.dim, self.pad_multiple, self.dense = num_features, dim, pad_multiple, dense
        self.num_pairs = rows.numel()
        self.pad = -(dim * dense + self.num_pairs) % pad_multiple
        self.out_features = dim * dense + self.num_pairs + self.pad

    def forward(self, dense: torch.Tensor | None, embedded: torch.Tensor) -> torch.Tensor:
        if dense is None:
            gram = torch.bmm(embedded, embedded.transpose(1, 2))  # [B, F, F]
            return F.pad(gram[:, self.rows, self.cols], (0, self.pad))
        dtype = torch.promote_types(dense.dtype, embedded.dtype)
        features = torch.cat([dense.unsqueeze(1).to(dtype), embedded.to(dtype)], dim=1)  # [B, F, D]
        gram = torch.bmm(features, features.transpose(1, 2))  # [B, F, F]
        pairs = gram[:, self.rows, self.cols]
        return F.pad(torch.cat([dense.to(pairs.dtype), pairs], dim=1), (0, self.pad))


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers: x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l, with rank-r U_l V_l."""

    def __init__(self, in_features: int, num_layers: int, rank: int):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(in_features, rank, bias=False) for _ in range(num_layers))
        self.up = nn.ModuleList(nn.Linear(rank, in_features) for _ in range(num_layers))
        self.out_features = in_features

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        """x0 [B, in_features], or its column blocks in order (concatenated here; a fused subclass may
        read them in place instead)."""
        x0 = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x


class FactorizationMachine(nn.Module):
    """Second-order FM term over field vectors: [B, F, D] -> [B].

    sum_{i<j} <v_i, v_j> = 0.5 * ((sum_i v_i)^2 - sum_i v_i^2), summed over D.
    """

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        square_of_sum = features.sum(dim=1).pow(2)  # [B, D]
        sum_of_squares = features.pow(2).sum(dim=1)  # [B, D]
        return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1)
