"""`LateLinear`: the same gradients as `nn.Linear`, computed after backward instead of during it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ctrflow.models.layers import MLP
from ctrflow.train.late_wgrad import LateLinear, defer_weight_grads, finish_weight_grads


def _grads(model: nn.Module, x: torch.Tensor, autocast: bool, passes: int = 1) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for k in range(passes):  # micro-batches: gradients add up
        xi = (x + k).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(xi)
        out.float().square().mean().backward()
        finish_weight_grads(model)
    return {"input": xi.grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("autocast", [False, True])
def test_late_linears_give_the_gradients_of_plain_ones(autocast):
    torch.manual_seed(0)
    plain = MLP(24, [32, 16, 1], last_activation=False)
    late = MLP(24, [32, 16, 1], last_activation=False)
    late.load_state_dict(plain.state_dict())
    assert defer_weight_grads(late) == 3
    assert late.state_dict().keys() == plain.state_dict().keys()  # checkpoints see no difference
    x = torch.randn(64, 24)
    for passes in (1, 2):
        want, got = _grads(plain, x, autocast, passes), _grads(late, x, autocast, passes)
        for name in want:
            # bf16: the same products, transposed (g^T x for autograd's (x^T g)^T)
            torch.testing.assert_close(got[name], want[name], rtol=0 if not autocast else 1e-2,
                                       atol=1e-6 if not autocast else 1e-3)
            assert got[name].dtype == want[name].dtype
    assert all(not m.pending for m in late.modules() if isinstance(m, LateLinear))


def test_weight_grads_wait_for_finish():
    layer = LateLinear(4, 3)
    layer(torch.randn(5, 4)).sum().backward()
    assert layer.weight.grad is None and len(layer.pending) == 1  # kept, not computed in backward
    finish_weight_grads(layer)
    assert layer.weight.grad.shape == (3, 4) and layer.bias.grad.shape == (3,) and not layer.pending
