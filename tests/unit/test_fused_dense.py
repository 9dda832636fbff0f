"""The fast path's dense swaps off the GPU: same function as the model's own layers."""

from __future__ import annotations

import torch

from ctrflow.accel.dense import align_linear_inputs
from ctrflow.accel.interaction import FusedDotInteraction
from ctrflow.models import build_model
from ctrflow.models.layers import DotInteraction
from ctrflow.contract.features import Features


def test_fused_dot_interaction_equals_plain_on_cpu():
    dense, embedded = torch.randn(5, 16), torch.randn(5, 26, 16)
    out = FusedDotInteraction(27, 16)(dense, embedded)
    torch.testing.assert_close(out, DotInteraction(27, 16)(dense, embedded))
    assert out.shape == (5, 368)  # 16 + 351 pairs, zero-padded to a multiple of 8


def test_dlrm_pads_the_top_mlp_input_like_mlperf():
    model = build_model("dlrm", Features.categorical([3] * 26, 13), 128, bottom_mlp=(8,), top_mlp=(8,))
    assert model.over_arch[0].in_features == 480  # 128 + 351 = 479, padded


def test_aligned_dlrm_gives_the_same_logits():
    sizes = [7] * 26
    model = build_model("dlrm", Features.categorical(sizes, 13), 16, bottom_mlp=(32,), top_mlp=(24,))
    aligned = build_model("dlrm", Features.categorical(sizes, 13), 16, bottom_mlp=(32,), top_mlp=(24,))
    assert align_linear_inputs(aligned) == 1  # 13 dense inputs (the model pads the top MLP's itself)
    dense, ids = torch.rand(9, 13), torch.randint(0, 7, (9, 26))
    torch.testing.assert_close(aligned(dense, ids), model(dense, ids))
    # the same parameters: the plain model loads the aligned one's checkpoint as is
    model.load_state_dict(aligned.state_dict())
    aligned(dense, ids).sum().backward()
    assert aligned.dense_arch[0].weight.grad.shape == (32, 13)
