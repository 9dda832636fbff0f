"""Parts shared by the ranking models: MLPs and the feature interactions."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class MLP(nn.Sequential):
    """Linear layers with ReLU between; `last_activation=False` leaves the output layer linear."""

    def __init__(self, in_features: int, sizes: Sequence[int], last_activation: bool = True):
        layers: list[nn.Module] = []
        for i, size in enumerate(sizes):
            layers.append(nn.Linear(in_features, size))
            if last_activation or i < len(sizes) - 1:
                layers.append(nn.ReLU())
            in_features = size
        super().__init__(*layers)
        self.out_features = in_features


class DotInteraction(nn.Module):
    """DLRM's pairwise dot products: [B, F, D] -> [B, F*(F-1)/2] (each pair once, no self-pairs)."""

    def __init__(self, num_features: int):
        super().__init__()
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.out_features = rows.numel()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(features, features.transpose(1, 2))  # [B, F, F]
        return gram[:, self.rows, self.cols]


class LowRankCrossNet(nn.Module):
    """DCNv2 cross layers: x_{l+1} = x0 * (U_l (V_l x_l) + b_l) + x_l, with rank-r U_l V_l."""

    def __init__(self, in_features: int, num_layers: int, rank: int):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(in_features, rank, bias=False) for _ in range(num_layers))
        self.up = nn.ModuleList(nn.Linear(rank, in_features) for _ in range(num_layers))
        self.out_features = in_features

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
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
