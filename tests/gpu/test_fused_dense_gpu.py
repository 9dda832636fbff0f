"""The fused dot interaction, the aligned Linear and the late-weight-gradient Linear against the model's own
layers, on the GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ctrflow.embedding.fused.dense import align_linear_inputs
from ctrflow.embedding.fused.interaction import FusedDotInteraction
from ctrflow.models.layers import MLP, DotInteraction
from ctrflow.train.late_wgrad import defer_weight_grads, finish_weight_grads

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


def test_late_weight_grads_equal_autograds_in_bf16_and_replayed_from_a_graph():
    torch.manual_seed(0)
    plain = MLP(480, [1024, 512, 1], last_activation=False).to(CUDA)
    late = MLP(480, [1024, 512, 1], last_activation=False).to(CUDA)
    late.load_state_dict(plain.state_dict())
    assert defer_weight_grads(late) == 3
    x = torch.randn(4096, 480, device=CUDA)

    def grads(model):
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        finish_weight_grads(model)
        return [p.grad.clone() for p in model.parameters()]

    want = grads(plain)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = grads(late)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grads(late)
    x.copy_(torch.randn_like(x))
    graph.replay()  # new inputs through the captured step
    want_new = grads(plain)
    for a, b, c, d in zip(eager, want, captured, want_new):
        assert a.dtype == b.dtype == torch.float32
        assert rel_err(a, b) < 1e-2 and rel_err(c, d) < 1e-2
