"""The fused dot interaction and the aligned Linear against the model's own layers, on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ctrflow.accel.dense import align_linear_inputs
from ctrflow.accel.interaction import FusedDotInteraction
from ctrflow.models.layers import MLP, DotInteraction

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("features,dim", [(27, 128), (9, 64)])
def test_dot_interaction_matches_plain(dtype, tol, features, dim):
    dense = torch.randn(1003, dim, device=CUDA, dtype=torch.float64)  # reference in float64
    emb = torch.randn(1003, features - 1, dim, device=CUDA, dtype=torch.float64)
    plain, fused = DotInteraction(features, dim).to(CUDA), FusedDotInteraction(features, dim).to(CUDA)
    df, ef = dense.to(dtype).requires_grad_(), emb.to(dtype).requires_grad_()
    dr, er = dense.to(dtype).double().requires_grad_(), emb.to(dtype).double().requires_grad_()
    out, ref = fused(df, ef), plain(dr, er)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < tol
    assert torch.all(out[:, dim + features * (features - 1) // 2:] == 0)
    # the gradient arrives as a strided slice of a wider tensor
    grad = torch.randn(ref.shape[0], ref.shape[1] + 9, device=CUDA, dtype=dtype)[:, 3:ref.shape[1] + 3]
    out.backward(grad)
    ref.backward(grad.double())
    assert rel_err(df.grad, dr.grad) < tol
    assert rel_err(ef.grad, er.grad) < tol


def test_aligned_linears_compute_the_same_function_with_the_same_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(MLP(13, [64, 32]), MLP(32, [16, 1], last_activation=False)).to(CUDA)
    aligned = nn.Sequential(MLP(13, [64, 32]), MLP(32, [16, 1], last_activation=False)).to(CUDA)
    aligned.load_state_dict(model.state_dict())
    assert align_linear_inputs(aligned) == 1
    opt_a, opt_b = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(aligned.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(256, 13, device=CUDA)
        for m, opt in ((model, opt_a), (aligned, opt_b)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    x = torch.randn(256, 13, device=CUDA)
    assert rel_err(aligned(x), model(x)) < 1e-5
    assert rel_err(aligned[0][0].weight, model[0][0].weight) < 1e-6
    assert aligned.state_dict().keys() == model.state_dict().keys()
