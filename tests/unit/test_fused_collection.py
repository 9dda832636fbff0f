"""FusedEmbeddingCollection off the GPU (its torch path): same tables, same updates as the plain path."""

from __future__ import annotations

import pytest
import torch

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.embedding.tables import tables_for
from ctrflow.errors import UserError
from ctrflow.features import Features

SIZES = [50, 3, 700, 10]
TABLES = tables_for(Features.categorical(dict(zip(["C1", "C2", "C3", "C4"], SIZES))).sparse, 8)


def batches(steps: int, batch: int = 64):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, n, (batch,), generator=gen) for n in SIZES], dim=1)
        yield ids, torch.randn(batch, len(SIZES), 8, generator=gen)


def test_starts_from_the_plain_collections_weights():
    plain, fused = EmbeddingCollection(TABLES, seed=4), FusedEmbeddingCollection(TABLES, seed=4)
    ids = next(batches(1))[0]
    assert torch.equal(fused(ids), plain(ids))
    for name, weight in plain.full_weights().items():
        assert torch.equal(fused.full_weights()[name], weight)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_updates_match_plain_sparse_optimizers(optimizer):
    plain = EmbeddingCollection(TABLES, seed=1)
    fused = FusedEmbeddingCollection.from_collection(plain, optimizer=optimizer, lr=0.05)
    params = list(plain.weights.values())
    opt = {"sgd": torch.optim.SGD, "rowwise_adagrad": RowwiseAdagrad, "adam": torch.optim.SparseAdam}[optimizer](
        params, lr=0.05)
    for ids, upstream in batches(4):
        opt.zero_grad(set_to_none=True)
        plain(ids).backward(upstream)
        opt.step()
        fused(ids).backward(upstream)
    # Adam divides by sqrt(v): an element whose summed grad nearly cancels amplifies rounding
    atol = 1e-4 if optimizer == "adam" else 1e-6
    for name, weight in plain.full_weights().items():
        torch.testing.assert_close(fused.full_weights()[name], weight, rtol=1e-5, atol=atol)


def test_has_no_parameters_for_dense_optimizers():
    fused = FusedEmbeddingCollection(TABLES)
    assert list(fused.parameters()) == [] and fused.weights == {}


def test_out_of_range_id_names_the_feature():
    ids = torch.zeros(2, 4, dtype=torch.int64)
    ids[1, 2] = 700
    with pytest.raises(UserError, match="C3"):
        FusedEmbeddingCollection(TABLES)(ids)
