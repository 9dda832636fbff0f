"""`--precision fp8` off the GPU: which layers it swaps, that checkpoints stay plain, the product's
numbers (torch's CPU `_scaled_mm`), and the refusal off CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ctrflow.config import TrainConfig
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.runtime import Runtime
from ctrflow.accel.fp8.apply import apply_fp8
from ctrflow.accel.fp8.linear import Fp8Linear, quantize_rows
from ctrflow.accel.plan import autocast_dtype
from ctrflow.accel.dense import compile_dense, use_compile
from ctrflow.contract.features import Features


def dcn() -> nn.Module:
    # 27 x 32 = 864 wide: cross layers 864 <-> 512 and the deep MLP's 864 -> 512 are >= 512 wide
    return build_model("dcnv2", Features.categorical([5] * 26, 13), 32, bottom_mlp=(16,), deep_mlp=(512, 64), cross_layers=2, cross_rank=512)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def test_apply_fp8_swaps_the_wide_layers_and_keeps_parameters_and_keys():
    model = dcn()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    assert apply_fp8(model) == 5  # 2 down, 2 up, the deep 864 -> 512; 512 -> 64 and smaller stay bf16
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert isinstance(model.over_arch[0], Fp8Linear) and type(model.over_arch[2]) is nn.Linear
    assert model.interaction.down[0].fp8_forward and model.interaction.down[0].fast_accum


def test_widening_rule_quantizes_only_the_narrow_operand():
    model = dcn()
    apply_fp8(model, rule="widening")
    down, up = model.interaction.down[0], model.interaction.up[0]  # 864 -> 512, 512 -> 864
    assert (down.fp8_forward, down.fp8_dgrad) == (False, True)
    assert (up.fp8_forward, up.fp8_dgrad) == (True, False)


def test_row_quantization_keeps_each_rows_scale():
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1, 1e3, 0, 5, 1]).unsqueeze(1)
    q, scale = quantize_rows(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.all(q[3].float() == 0)  # an all-zero row stays zero
    back = q.float() * scale
    for i in (0, 1, 2, 4):
        assert rel_err(back[i], x[i]) < 0.05  # 3 mantissa bits, whatever the row's magnitude


def test_fp8_linear_computes_the_linear_function():
    torch.manual_seed(0)
    plain = nn.Linear(64, 48)
    fast = Fp8Linear.from_linear(nn.Linear(64, 48), fast_accum=False)
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(32, 64)
    xp, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_p, out_f = plain(xp), fast(xf)
    assert out_f.dtype == torch.float32  # no autocast: the input's dtype, as nn.Linear
    assert rel_err(out_f, out_p) < 0.06
    grad = torch.randn_like(out_p)
    out_p.backward(grad)
    out_f.backward(grad)
    assert rel_err(xf.grad, xp.grad) < 0.12  # e5m2 gradients: 2 mantissa bits
    assert rel_err(fast.weight.grad, plain.weight.grad) < 0.02  # dW stays a bf16 product


def test_fp8_is_refused_off_cuda():
    with pytest.raises(UserError, match="fp8 needs a CUDA GPU"):
        autocast_dtype(TrainConfig(out="x", precision="fp8"), Runtime(0, 1, 0, torch.device("cpu")))


@pytest.mark.parametrize("name", ["dcnv2", "dlrm"])
def test_compiled_dense_parts_keep_the_checkpoint_keys(name):
    model = dcn() if name == "dcnv2" else build_model("dlrm", Features.categorical([5] * 26, 13), 16, bottom_mlp=(8,), top_mlp=(8,))
    keys = list(model.state_dict())
    assert compile_dense(model)  # lazy: nothing is built until the first call
    assert list(model.state_dict()) == keys  # checkpoints see the plain model's keys
    assert ("head" in vars(model)) == (name == "dcnv2")  # DLRM: its parts, in place
    assert not use_compile(TrainConfig(out="x"), Runtime(0, 1, 0, torch.device("cpu")))
