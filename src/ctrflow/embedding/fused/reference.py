"""Plain-PyTorch optimizers for sparse table gradients that torch lacks: the reference of the fused ones."""

from __future__ import annotations

import torch


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for sparse gradients (one accumulator per table row, as in FBGEMM/TorchRec).

    For each touched row r with summed gradient g_r [D]: s_r += mean(g_r^2);
    w_r -= lr * g_r / (sqrt(s_r) + eps). Untouched rows and their accumulators stay as they are.
    """

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a (sparse or dense) gradient."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.zeros(p.shape[0], device=p.device)
                grad = p.grad.coalesce() if p.grad.is_sparse else p.grad.to_sparse(1).coalesce()
                rows, values = grad.indices()[0], grad.values().float()
                total = state["sum"][rows] + values.pow(2).mean(dim=1)
                state["sum"][rows] = total
                step = values / (total.sqrt().unsqueeze(1) + group["eps"])
                p[rows] = (p[rows].float() - group["lr"] * step).to(p.dtype)
        return None
