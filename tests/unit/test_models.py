"""Models: logits of the right shape, learning on tiny data, deterministic construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctrflow.config import ModelConfig, OptimConfig
from ctrflow.datasets.criteo.columns import SPARSE
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.models import MODELS, build_model, embedding_collections, replace_module
from ctrflow.train.optim import build_optimizers
from ctrflow.features import Features

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

SIZES = [30 + i for i in range(len(SPARSE))]


def tiny_problem(rows: int = 256, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sparse = torch.randint(0, 30, (rows, len(SPARSE)), generator=gen)
    dense = torch.rand(rows, 13, generator=gen) * 3
    weights = torch.randn(len(SPARSE), 30, generator=gen)
    logits = weights[torch.arange(len(SPARSE)), sparse].sum(1) / 2 + dense[:, 0] - 1.5
    labels = (torch.rand(rows, generator=gen) < torch.sigmoid(logits)).float()
    return dense, sparse, labels


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_maps_a_batch_to_one_logit_per_row(name):
    model = build_model(name, Features.categorical(SIZES, 13), 8, **ModelConfig(name=name, cross_rank=4).arch_kwargs())
    dense, sparse, _ = tiny_problem(7)
    logits = model(dense, sparse)
    assert logits.shape == (7,)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_learns_tiny_data(name):
    torch.manual_seed(0)
    model = build_model(name, Features.categorical(SIZES, 13), 8, **ModelConfig(name=name, cross_rank=4).arch_kwargs())
    optimizers = build_optimizers(model, OptimConfig(lr=3e-3, sparse_lr=0.05))
    dense, sparse, labels = tiny_problem()
    losses = []
    for _ in range(30):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_same_seed_builds_the_same_weights_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b = build_model("dlrm", Features.categorical(SIZES, 13), 8, seed=3), build_model("dlrm", Features.categorical(SIZES, 13), 8, seed=3)
    c = build_model("dlrm", Features.categorical(SIZES, 13), 8, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embeddings.weights["t_C1"], c.embeddings.weights["t_C1"])


def test_embedding_collections_finds_every_table_and_can_swap_one():
    model = build_model("deepfm", Features.categorical(SIZES, 13), 8)
    collections = embedding_collections(model)
    assert sorted(collections) == ["embeddings", "linear_embeddings"]
    assert collections["linear_embeddings"].embedding_dim == 1
    replacement = EmbeddingCollection(collections["embeddings"].tables, seed=9)
    replace_module(model, "embeddings", replacement)
    assert model.embeddings is replacement


def test_unknown_model_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="dlrm"):
        build_model("transformer", Features.categorical(SIZES, 13), 8)
