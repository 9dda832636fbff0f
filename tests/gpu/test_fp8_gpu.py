"""FP8 Linear layers against the plain bf16 path on the GPU: values, gradients, optimizer state,
the compiled and the CUDA-graphed step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ctrflow.models import build_model
from ctrflow.accel.fp8.apply import apply_fp8
from ctrflow.accel.fp8.linear import E4M3, E5M2, Fp8Linear
from ctrflow.contract.features import Features

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="fp8 tensor cores need compute capability 8.9+")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("rowwise,grad_dtype,fast", [(True, E5M2, False), (True, E4M3, False),
                                                     (False, E5M2, False), (True, E5M2, True)])
def test_fp8_linear_matches_bf16_linear(rowwise, grad_dtype, fast):
    torch.manual_seed(0)
    plain = nn.Linear(512, 1024).to(CUDA)
    fast = Fp8Linear.from_linear(copy.deepcopy(plain), grad_dtype=grad_dtype, rowwise=rowwise, fast_accum=fast)
    x = torch.randn(4096, 512, device=CUDA)
    x[::7] *= 30  # rows of other magnitudes: what row scales are for
    grad = torch.randn(4096, 1024, device=CUDA)
    outs = []
    for layer in (plain, fast):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = layer(xi)
        out.backward(grad.to(out.dtype))
        outs.append((out, xi.grad, layer.weight.grad, layer.bias.grad))
    (out_p, dx_p, dw_p, db_p), (out_f, dx_f, dw_f, db_f) = outs
    assert out_f.dtype == torch.bfloat16 and out_f.shape == out_p.shape
    assert rel_err(out_f, out_p) < 0.05  # e4m3: 3 mantissa bits on each operand
    assert rel_err(dx_f, dx_p) < (0.1 if grad_dtype == E5M2 else 0.05)
    assert rel_err(dw_f, dw_p) < 1e-2  # dW stays a bf16 product
    assert rel_err(db_f, db_p) < 1e-2


def _dcn(fp8: str) -> nn.Module:
    model = build_model("dcnv2", Features.categorical([50] * 26, 13), 32, bottom_mlp=(64,), deep_mlp=(512, 256),
                        cross_layers=2, cross_rank=512).to(CUDA)
    if fp8:
        # 864 = 27 x 32 wide: cross layers 864 <-> 512, deep 864 -> 512
        assert apply_fp8(model, rule=fp8) == 5
    model.embeddings.requires_grad_(False)  # sparse gradients: not Adam's; the dense part is tested
    return model


def _train(model: nn.Module, batches: list, compiled: bool = False) -> torch.optim.Adam:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    head = torch.compile(model.head) if compiled else model.head
    for dense, ids, labels in batches:
        opt.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            logits = head(dense, model.embeddings(ids))
        F.binary_cross_entropy_with_logits(logits.float(), labels).backward()
        opt.step()
    return opt


def _batches(count: int) -> list:
    gen = torch.Generator(device=CUDA).manual_seed(1)
    out = []
    for _ in range(count):  # labels a function of the inputs: gradients with a direction, not noise
        dense = torch.randn(2048, 13, device=CUDA, generator=gen)
        ids = torch.randint(0, 50, (2048, 26), device=CUDA, generator=gen)
        out.append((dense, ids, (dense[:, 0] + (ids[:, 0] % 3) > 1).float()))
    return out


@pytest.mark.parametrize("rule,compiled", [("all", False), ("all", True), ("widening", True)])
def test_fp8_dcnv2_training_tracks_bf16(rule, compiled):
    batches = _batches(6)
    plain, fast = _dcn(""), _dcn(rule)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    opt_p, opt_f = _train(plain, batches), _train(fast, batches, compiled)
    assert set(fast.state_dict()) == set(plain.state_dict())  # checkpoints cross paths
    if rule == "widening":  # cross down 864 -> 512: only its input-gradient product; up: only forward
        assert not fast.interaction.down[0].fp8_forward and fast.interaction.down[0].fp8_dgrad
        assert fast.interaction.up[0].fp8_forward and not fast.interaction.up[0].fp8_dgrad
    for (name, p), q in zip(plain.named_parameters(), fast.parameters()):
        if name.startswith("embeddings"):
            continue
        moved = p - start[name]
        # the update, not the weight; Adam's first steps are ~sign(g): small gradients flip
        assert rel_err(q - start[name], moved) < 0.4, name
        state_p, state_f = opt_p.state[p], opt_f.state[q]
        assert rel_err(state_f["exp_avg"], state_p["exp_avg"]) < 0.15, name
        assert rel_err(state_f["exp_avg_sq"], state_p["exp_avg_sq"]) < 0.2, name
    dense, ids, _ = _batches(7)[-1]
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        assert rel_err(fast(dense, ids).float(), plain(dense, ids).float()) < 0.05


def test_fp8_step_replays_in_a_cuda_graph():
    torch.manual_seed(0)
    layer = Fp8Linear(1024, 512).to(CUDA)
    eager = copy.deepcopy(layer)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, capturable=True) for m in (layer, eager)]
    x = torch.randn(2048, 1024, device=CUDA)

    def step(m, opt, inp):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = m(inp).float().square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(layer, opts[0], static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layer, opts[0], static)
    step(eager, opts[1], x)  # the warm-up step
    for i in range(3):
        static.copy_(x * (i + 1))
        graph.replay()
        step(eager, opts[1], x * (i + 1))
    torch.cuda.synchronize()
    assert rel_err(layer.weight, eager.weight) < 1e-5
    assert rel_err(opts[0].state[layer.weight]["exp_avg_sq"], opts[1].state[eager.weight]["exp_avg_sq"]) < 1e-5
