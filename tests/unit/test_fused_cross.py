"""`FusedCrossNet` off the GPU: the fused backward's algebra (its epilogues in torch) against autograd
of the plain cross layers, and the module's drop-in behaviour (same parameters, plain path on the CPU)."""

from __future__ import annotations

import torch

from ctrflow.embedding.fused.cross import FusedCrossNet, cross_layers
from ctrflow.models.layers import LowRankCrossNet


def test_fused_cross_algebra_matches_autograd_of_the_plain_layers():
    torch.manual_seed(0)
    plain = LowRankCrossNet(24, num_layers=3, rank=8).double()
    for up in plain.up:
        torch.nn.init.normal_(up.bias)  # nonzero biases: their gradients are checked too
    x0 = torch.randn(10, 24, dtype=torch.float64)
    grad = torch.randn(10, 24, dtype=torch.float64)
    outs = []
    for fused in (False, True):
        plain.zero_grad()
        x = x0.clone().requires_grad_()
        if fused:
            y = cross_layers(x, [m.weight for m in plain.down], [m.weight for m in plain.up],
                             [m.bias for m in plain.up])
        else:
            y = plain(x)
        y.backward(grad)
        outs.append([y, x.grad, *(p.grad.clone() for p in plain.parameters())])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_fused_cross_net_is_a_drop_in_with_the_same_parameters():
    plain = LowRankCrossNet(16, num_layers=2, rank=4)
    fused = FusedCrossNet.from_plain(plain)
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert [id(p) for p in fused.parameters()] == [id(p) for p in plain.parameters()]
    x0 = torch.randn(5, 16)
    assert not fused.fusable(x0)  # the CPU keeps the plain code
    torch.testing.assert_close(fused(x0), plain(x0))
