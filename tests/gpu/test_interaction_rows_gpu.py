"""`FusedDotInteraction` reading embeddings where a sharded exchange left them (`read_rows`), on the GPU."""

from __future__ import annotations

import pytest
import torch

from ctrflow.accel.interaction import FusedDotInteraction

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def exchange_layout(features: int) -> torch.Tensor:
    """[3, F-1] row map of three blocks of features (as three ranks' returned embeddings): batch scale,
    sample stride, first row."""
    rows = torch.zeros(3, features - 1, dtype=torch.int64)
    start = 0
    for group in (range(0, 5), range(5, 7), range(7, features - 1)):
        for k, f in enumerate(group):
            rows[:, f] = torch.tensor([start, len(group), k])
        start += len(group)
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mapped_rows_give_the_plain_kernels_results_bit_for_bit(dtype):
    batch, features, dim = 1003, 27, 128  # a batch no multiple of the samples per program
    rows = exchange_layout(features).to(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    dense = torch.randn(batch, dim, device=CUDA, generator=gen).to(dtype)
    buffer = torch.randn(batch * (features - 1), dim, device=CUDA, generator=gen).to(dtype)
    at = torch.arange(batch, device=CUDA).unsqueeze(1)
    index = batch * rows[0] + at * rows[1] + rows[2]  # [B, F-1] buffer row of each embedding
    plain_emb = buffer[index].requires_grad_()
    mapped_emb = buffer.view(batch, features - 1, dim).clone().requires_grad_()
    plain, mapped = FusedDotInteraction(features, dim).to(CUDA), FusedDotInteraction(features, dim).to(CUDA)
    mapped.read_rows(rows)
    dp, dm = dense.clone().requires_grad_(), dense.clone().requires_grad_()
    out_plain, out_mapped = plain(dp, plain_emb), mapped(dm, mapped_emb)
    assert torch.equal(out_plain, out_mapped)
    grad = torch.randn(out_plain.shape, device=CUDA, generator=gen).to(dtype)
    out_plain.backward(grad)
    out_mapped.backward(grad)
    assert torch.equal(dp.grad, dm.grad)
    assert torch.equal(plain_emb.grad, mapped_emb.grad.view(-1, dim)[index])
