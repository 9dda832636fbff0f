"""The embedding L2 in the Triton update kernel (`apply_update_kernel`) against its torch reference
(`ops.apply_reference`, the CPU path): weights and optimizer state after several steps of SGD,
row-wise Adagrad and lazy Adam with l2 > 0, on skewed ids (hot rows summed from many items)."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.tables import tables_for
from ctrflow.contract.features import Features

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SIZES = [5000, 3, 70000, 10, 1, 257]
L2 = 0.1  # larger than the default, so that a kernel that skips it is far outside the tolerance


def skewed_ids(batch: int, gen: torch.Generator) -> torch.Tensor:
    """[B, F] ids (CPU) with heavy repeats (Zipf-like)."""
    n = torch.tensor(SIZES, dtype=torch.float64)
    u = torch.rand(batch, len(SIZES), generator=gen, dtype=torch.float64)
    return torch.minimum(torch.exp(u * torch.log1p(n)).long() - 1, n.long() - 1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def train_both(optimizer: str, lr: float, l2: float, pre_reduce: bool, steps: int = 4, dim: int = 64):
    """The same fused collection on the GPU (Triton kernels) and on the CPU (torch reference), trained
    on the same batches: (gpu collection, cpu collection, the initial whole tables)."""
    tables = tables_for(Features.categorical(dict(zip([f"C{i + 1}" for i in range(len(SIZES))], SIZES))).sparse, dim)
    plain = EmbeddingCollection(tables, seed=3)
    start = {k: v.clone() for k, v in plain.full_weights().items()}
    colls = [FusedEmbeddingCollection.from_collection(plain, optimizer=optimizer, lr=lr, l2=l2, device=device,
                                                      pre_reduce=pre_reduce) for device in ("cuda", "cpu")]
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = skewed_ids(4096, gen)
        upstream = torch.randn(4096, len(SIZES), dim, generator=gen)
        for coll in colls:
            device = coll.weight.device
            coll(ids.to(device)).backward(upstream.to(device))
    torch.cuda.synchronize()
    return colls[0], colls[1], start


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.5), ("rowwise_adagrad", 0.05), ("adam", 0.01)])
@pytest.mark.parametrize("pre_reduce", [True, False])
def test_kernel_l2_matches_the_reference(optimizer, lr, pre_reduce):
    gpu, cpu, _ = train_both(optimizer, lr, L2, pre_reduce)
    tol = 2e-4 if optimizer == "adam" else 2e-5  # Adam divides by sqrt(v): near-cancelling sums amplify rounding
    for name, weight in cpu.full_weights().items():
        assert rel_err(gpu.full_weights()[name], weight) < tol, name
    for key, value in cpu.optimizer_state().items():
        if value.numel() > 1:  # SGD's one-element placeholders hold nothing
            assert rel_err(gpu.optimizer_state()[key], value) < tol, key
    # the penalty was applied: the same steps without it end elsewhere
    gpu0, _, _ = train_both(optimizer, lr, 0.0, pre_reduce)
    assert max(rel_err(gpu.full_weights()[n], w) for n, w in gpu0.full_weights().items()) > 10 * tol


def test_untouched_rows_keep_their_weights_under_the_kernel_l2():
    gpu, _, start = train_both("adam", 0.01, L2, True, steps=2)
    table = gpu.full_weights()["t_C3"].cpu()  # 70,000 rows: most never drawn
    touched = torch.zeros(SIZES[2], dtype=torch.bool)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        touched[skewed_ids(4096, gen)[:, 2]] = True
        torch.randn(4096, len(SIZES), 64, generator=gen)  # keep the generator in step with `train_both`
    assert not touched.all()
    assert torch.equal(table[~touched], start["t_C3"][~touched])
    assert not torch.equal(table[touched], start["t_C3"][touched])
