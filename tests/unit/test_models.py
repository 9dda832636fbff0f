"""Models: logits of the right shape, learning on tiny data, deterministic construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctrflow.config import ModelConfig, OptimConfig
from ctrflow.contract.criteo import SPARSE
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.models import MODELS, build_model, embedding_collections, replace_module
from ctrflow.train.optim import build_optimizers
from ctrflow.contract.features import Features

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

SIZES = [30 + i for i in range(len(SPARSE))]


def small_arch(name: str) -> dict:
    """Model `name`'s settings with DCNv2's cross rank cut to 4 (other models pass over it)."""
    return ModelConfig.from_dict({"name": name, "cross_rank": 4}).arch_kwargs()


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
    model = build_model(name, Features.categorical(SIZES, 13), 8, **small_arch(name))
    dense, sparse, _ = tiny_problem(7)
    logits = model(dense, sparse)
    assert logits.shape == (7,)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_learns_tiny_data(name):
    torch.manual_seed(0)
    model = build_model(name, Features.categorical(SIZES, 13), 8, **small_arch(name))
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


# --- any feature set: multi-hot bags, no dense features, no sparse features ---------------------------------------

import math  # noqa: E402

import numpy as np  # noqa: E402

from tests.fixtures.multihot import draw_rows, mixed_features

FEATURE_SETS = {"multi_hot": mixed_features(2, 2, 2), "no_dense": mixed_features(0, 1, 2),
                "no_sparse": mixed_features(3, 0, 0)}


def feature_problem(features: Features, rows: int = 256, seed: int = 0):
    """(dense, sparse, labels) tensors with labels from a hidden logistic model of every input."""
    rng = np.random.default_rng(seed)
    dense, sparse = draw_rows(features, rows, rng)
    logits = np.full(rows, -1.0)
    for f, (a, b) in zip(features.sparse, features.slot_spans()):
        w = rng.normal(0, 1.5, f.cardinality)
        w[0] = 0.0
        logits += w[sparse[:, a:b]].sum(1) / (b - a) ** 0.5
    if features.num_dense:
        logits += 2 * (dense - dense.mean(0)) @ rng.normal(0, 1, features.num_dense)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return torch.from_numpy(dense), torch.from_numpy(sparse.astype(np.int64)), torch.from_numpy(labels)


@pytest.mark.parametrize("kind", list(FEATURE_SETS))
@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_learns_any_feature_set(name, kind):
    features = FEATURE_SETS[kind]
    model = build_model(name, features, 8, **small_arch(name))
    # a toy's fast rates, without the embedding L2: DLRM without dense features reaches the output only
    # through products of embeddings, and 40 steps on 256 rows are too few to pull them away from zero
    optimizers = build_optimizers(model, OptimConfig(lr=3e-3, sparse_lr=0.05, embedding_l2=0.0))
    dense, sparse, labels = feature_problem(features)
    assert dense.shape[1] == features.num_dense and sparse.shape[1] == features.slots
    losses = []
    for _ in range(40):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses


def test_dlrm_without_dense_features_has_no_bottom_mlp():
    model = build_model("dlrm", FEATURE_SETS["no_dense"], 8)
    assert model.dense_arch is None and not model.interaction.dense
    assert model.interaction.num_features == 3  # the three sparse features interact among themselves
    with_dense = build_model("dlrm", FEATURE_SETS["multi_hot"], 8)
    assert with_dense.dense_arch is not None and with_dense.interaction.num_features == 5


def test_dropout_drops_while_training_and_not_in_eval():
    features = FEATURE_SETS["multi_hot"]
    dense, sparse, _ = feature_problem(features, rows=64)
    for name in MODELS:
        plain = build_model(name, features, 8, seed=2)
        dropped = build_model(name, features, 8, seed=2, dropout=0.5)
        assert torch.equal(plain.eval()(dense, sparse), dropped.eval()(dense, sparse)), name  # same weights
        dropped.train()
        assert not torch.equal(dropped(dense, sparse), dropped(dense, sparse)), name


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_starts_at_the_click_rate(name):
    features = Features.categorical(SIZES, 13)
    model = build_model(name, features, 8, **small_arch(name))
    model.set_output_bias(0.2)
    dense, sparse, _ = tiny_problem(512)
    logits = model(dense, sparse).detach()
    assert abs(float(logits.median()) - math.log(0.2 / 0.8)) < 0.5, float(logits.median())
    if model.linear_embeddings is not None:  # first-order terms start at zero, as a linear model does
        assert torch.equal(model.first_order(dense, sparse), torch.zeros(512))


def test_a_model_takes_its_own_settings_and_refuses_another_models():
    model = build_model("dcnv2", Features.categorical(SIZES, 13), 8, cross_layers=2, cross_rank=4, deep_mlp=[16])
    assert (len(model.interaction.down), model.interaction.down[0].out_features) == (2, 4)
    assert model.over_arch[0].out_features == 16  # a checkpoint's JSON lists widths: read as a tuple
    with pytest.raises(TypeError, match="cross_rank"):
        build_model("dlrm", Features.categorical(SIZES, 13), 8, cross_rank=4)


def test_the_registry_refuses_a_second_name_and_a_setting_of_another_type():
    from dataclasses import dataclass

    from ctrflow.models import spec

    @dataclass(frozen=True)
    class Clash:
        cross_rank: float = 0.5  # DCNv2's is an int: one flag could not parse both

    with pytest.raises(ValueError, match="registered twice"):
        spec.register("dlrm", MODELS["dlrm"].model, MODELS["dlrm"].config)
    with pytest.raises(TypeError, match="setting 'cross_rank'"):
        spec.register("clash", MODELS["dcnv2"].model, Clash)
    assert "clash" not in spec.MODELS
