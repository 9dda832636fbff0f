"""Ranking models: DLRM, DCNv2, DeepFM, Wide&Deep.

Every model maps `dense` [B, num_dense] float32 and `sparse` [B, slots] int ids (the feature
contract, `ctrflow.contract.features`) to logits [B] and is a `RankingModel`, a composition of named parts:
`dense_arch` -> `embeddings` -> `interaction` -> `over_arch` (`ctrflow.models.base`).
Models know nothing of devices, processes, sharding, the loss or any dataset.

Every embedding table lives in an `ctrflow.embedding.collection.EmbeddingCollection`:
`model.embeddings` (the [B, T, D] vectors) and, for DeepFM and Wide&Deep, `model.linear_embeddings`
(dim-1 first-order weights). `embedding_collections(model)` finds them all by module type, by
dotted path; a sharding step swaps one for a sharded equivalent with
`replace_module(model, path, new)`. Code that handles weights (optimizers, checkpoints) goes
through these two functions, never through the attribute names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.contract.features import Features
from ctrflow.models.base import RankingModel
from ctrflow.models.dcnv2 import DCNv2
from ctrflow.models.deepfm import DeepFM
from ctrflow.models.dlrm import DLRM
from ctrflow.models.wide_deep import WideDeep

MODELS: dict[str, type[RankingModel]] = {"dlrm": DLRM, "dcnv2": DCNv2, "deepfm": DeepFM, "wide_deep": WideDeep}


def build_model(name: str, features: Features, embedding_dim: int = 16, seed: int = 0,
                **arch: Any) -> RankingModel:
    """A freshly initialised model; the same arguments give the same weights, on any machine.

    `features` is the feature contract (`Schema.features`, or any object with a `features`
    attribute holding one); `arch` holds the architecture's own settings (`ModelConfig.arch_kwargs()`)
    and may set `embedding_init_scale` (the tables' uniform(+-1/sqrt(rows)) draw is multiplied by it;
    default `base.EMBEDDING_INIT_SCALE`, 0.1; 1.0 is DLRM's reference init).
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    features = getattr(features, "features", features)  # a Schema carries its features
    if not isinstance(features, Features):
        raise TypeError(f"build_model takes the feature contract (ctrflow.contract.features.Features), got {type(features)}")
    # dense layers draw from the global generator: fork it so building a model has no side effect
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](features, embedding_dim=embedding_dim, seed=seed, **arch)


def embedding_collections(model: nn.Module) -> dict[str, nn.Module]:
    """Every embedding collection of `model`, by dotted module path (`{"embeddings": ...}`).

    Matches plain `EmbeddingCollection`s and any module that declares itself one by exposing
    `full_weights()` (a sharded collection), without descending into them.
    """
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if any(path.startswith(p + ".") for p in found):
            continue
        if isinstance(module, EmbeddingCollection) or (path and hasattr(module, "full_weights")):
            found[path] = module
    return found


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put `new` where the submodule at dotted `path` was (e.g. a sharded collection)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, new)


__all__ = ["DCNv2", "DLRM", "DeepFM", "MODELS", "RankingModel", "WideDeep", "build_model", "embedding_collections",
           "replace_module"]
