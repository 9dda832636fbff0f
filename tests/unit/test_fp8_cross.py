"""`Fp8CrossNet` off the GPU: its algebra (the torch references the kernels mirror, torch's CPU
`_scaled_mm`) against the cross layers' own fp8 formula and the plain fp32 layers; the swap."""

from __future__ import annotations

import copy

import pytest
import torch

from ctrflow.models import build_model
from ctrflow.models.layers import LowRankCrossNet
from ctrflow.accel.fp8.apply import apply_fp8
from ctrflow.accel.fp8.linear import E5M2, Fp8Linear
from ctrflow.accel.fp8.cross import AbsorbedFp8Linear, Fp8CrossNet, dx0_reference
from ctrflow.contract.features import Features


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def cross_pair(layers: int = 2):
    """(plain fp32 cross layers, an Fp8CrossNet over a copy of the same weights)."""
    torch.manual_seed(0)
    plain = LowRankCrossNet(96, layers, 32)
    for up in plain.up:  # non-trivial h, so that every term of the gradient counts
        torch.nn.init.normal_(up.bias, std=0.5)
    holder = torch.nn.Sequential(copy.deepcopy(plain))
    assert apply_fp8(holder, min_features=16) == 2 * layers
    assert isinstance(holder[0], Fp8CrossNet)
    return plain, holder[0]


def run(net, x0: torch.Tensor, grad: torch.Tensor, fallback: bool = False):
    x = x0.clone().requires_grad_()
    out = LowRankCrossNet.forward(net, x) if fallback else net(x)
    out.backward(grad)
    return out, x.grad, [p.grad for p in net.parameters()]


@pytest.mark.parametrize("layers", [1, 3])
def test_fused_cross_layers_are_as_accurate_as_the_layers_own_fp8_formula(layers):
    plain, fused = cross_pair(layers)
    x0 = torch.randn(64, 96)
    x0[::5] *= 20  # rows of other magnitudes: what row scales are for
    grad = torch.randn(64, 96)
    want = run(plain, x0, grad)
    got = run(fused, x0, grad)
    fused.zero_grad()
    own = run(fused, x0, grad, fallback=True)  # Fp8Linear by Fp8Linear, as before the swap
    assert got[0].dtype == torch.float32  # no autocast: the input's dtype, as nn.Linear
    assert rel_err(got[0], want[0]) < 0.1  # e4m3 operands
    # every output, input gradient and weight gradient no farther from fp32 than the fp8 layers' own
    for a, b, c in zip([got[0], got[1], *got[2]], [own[0], own[1], *own[2]], [want[0], want[1], *want[2]]):
        assert rel_err(a, c) < 1.15 * rel_err(b, c) + 0.01


def test_x0_in_two_parts_gives_what_the_concatenated_x0_gives():
    plain, fused = cross_pair(3)
    x0, grad = torch.randn(64, 96), torch.randn(64, 96)
    for net in (plain, fused):
        whole = run(net, x0, grad)
        net.zero_grad()
        x = x0.clone().requires_grad_()
        out = net(x[:, :16], x[:, 16:])  # DCNv2: the dense arch's output, then the lookups
        out.backward(grad)
        for a, b in zip([out, x.grad, *(p.grad for p in net.parameters())], [whole[0], whole[1], *whole[2]]):
            assert rel_err(a, b) < 1e-6


def test_x0_gradient_pass_sums_every_layers_terms():
    torch.manual_seed(1)
    g, ds, hs = torch.randn(8, 16), [torch.randn(8, 16) for _ in range(3)], [torch.randn(8, 16) for _ in range(3)]
    # top down: G3 = g, G2 = G3 + D2, G1 = G2 + D1; dx0 = G3 h2 + G2 h1 + G1 h0 + G1 + D0
    g2, g1 = g + ds[0], g + ds[0] + ds[1]
    want = g * hs[0] + g2 * hs[1] + g1 * hs[2] + g1 + ds[2]
    assert rel_err(dx0_reference(g.bfloat16(), [d.bfloat16() for d in ds], [h.bfloat16() for h in hs]), want) < 0.01


def test_apply_fp8_swaps_only_cross_layers_it_can_fuse():
    model = build_model("dcnv2", Features.categorical([5] * 26, 13), 32, bottom_mlp=(16,), deep_mlp=(512, 64), cross_layers=2, cross_rank=512)
    keys = list(model.state_dict())
    unfused, widening, alone = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    assert apply_fp8(model) == 5
    assert type(model.interaction) is Fp8CrossNet and list(model.state_dict()) == keys
    assert isinstance(model.interaction.down[0], Fp8Linear) and model.interaction.options() == (E5M2, True)
    assert type(model.over_arch[0]) is AbsorbedFp8Linear and model.interaction.absorbed == (model.over_arch[0],)
    apply_fp8(alone, absorb=False)
    assert type(alone.interaction) is Fp8CrossNet and type(alone.over_arch[0]) is Fp8Linear
    apply_fp8(unfused, fuse_cross=False)
    apply_fp8(widening, rule="widening")  # not every product in fp8: the layers' own formula
    assert type(unfused.interaction) is LowRankCrossNet and type(widening.interaction) is LowRankCrossNet


def test_fused_cross_training_steps_track_the_plain_layers():
    plain, fused = cross_pair(2)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (plain, fused)]
    gen = torch.Generator().manual_seed(2)
    start = [p.detach().clone() for p in plain.parameters()]
    for _ in range(4):
        x0 = torch.randn(64, 96, generator=gen)
        target = torch.randn(64, 96, generator=gen)
        for net, opt in zip((plain, fused), opts):
            opt.zero_grad()
            (net(x0) - target).square().mean().backward()
            opt.step()
    for p, q, s in zip(plain.parameters(), fused.parameters(), start):
        assert rel_err(q - s, p - s) < 0.3  # Adam's first steps are ~sign(g): small gradients flip


def test_dcnv2_with_the_absorbed_deep_layer_is_as_accurate_as_the_layers_own_fp8_formula():
    torch.manual_seed(3)
    # tables at DLRM's full uniform draw: the magnitudes this comparison of fp8 formulas was set for
    plain = build_model("dcnv2", Features.categorical([5] * 26, 13), 32, bottom_mlp=(16,), deep_mlp=(512, 64), cross_layers=2, cross_rank=512,
                        embedding_init_scale=1.0)
    fused, own = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_fp8(fused)
    apply_fp8(own, fuse_cross=False)
    dense, ids = torch.randn(48, 13), torch.randint(0, 5, (48, 26))
    results = []
    for model in (plain, own, fused):  # the fp8 paths as on the GPU: bf16 between the products
        with torch.autocast("cpu", torch.bfloat16, enabled=model is not plain):
            loss = model(dense, ids).float().square().sum()
        loss.backward()
        results.append({k: p.grad for k, p in model.named_parameters() if not k.startswith("embeddings")})
    want, mine, theirs = results[0], results[2], results[1]
    assert set(mine) == set(want) and mine["over_arch.0.weight"] is not None
    for k in want:  # every dense gradient, the absorbed layer's and the bottom MLP's (through x0) too
        assert rel_err(mine[k], want[k]) < 1.15 * rel_err(theirs[k], want[k]) + 0.01, k
