"""Ranking models: DLRM, DCNv2, DeepFM, Wide&Deep, each registered by its own file.

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

Each model file declares its class and its own settings and registers them (`ctrflow.models.spec`);
importing it below is its one registration line.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import nn

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.contract.features import Features
# the registration lines: each file registers its model, in the order `--model` lists them
from ctrflow.models import dlrm, dcnv2, deepfm, wide_deep  # noqa: F401, I001
from ctrflow.models.base import RankingModel
from ctrflow.models.dcnv2 import DCNv2
from ctrflow.models.deepfm import DeepFM
from ctrflow.models.dlrm import DLRM
from ctrflow.models.spec import MODELS, ModelSpec, register, spec_of
from ctrflow.models.wide_deep import WideDeep


def build_model(name: str, features: Features, embedding_dim: int = 16, seed: int = 0,
                **arch: Any) -> RankingModel:
    """A freshly initialised model; the same arguments give the same weights, on any machine.

    `features` is the feature contract (`Schema.features`, or any object with a `features`
    attribute holding one); `arch` holds the model's own settings (its registered settings class's
    fields; those left out keep their defaults), `dropout`, and `embedding_init_scale` (the tables'
    uniform(+-1/sqrt(rows)) draw is multiplied by it; default `base.EMBEDDING_INIT_SCALE`, 0.1; 1.0 is
    DLRM's reference init): `ModelConfig.arch_kwargs()` and a checkpoint's `meta.json` give them.
    """
    spec = spec_of(name)
    own = {f.name for f in fields(spec.config)}
    settings = spec.config(**{k: tuple(v) if isinstance(v, list) else v for k, v in arch.items() if k in own})
    features = getattr(features, "features", features)  # a Schema carries its features
    if not isinstance(features, Features):
        raise TypeError(f"build_model takes the feature contract (ctrflow.contract.features.Features), got {type(features)}")
    # dense layers draw from the global generator: fork it so building a model has no side effect
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.model(features, embedding_dim, settings, seed=seed, **{k: v for k, v in arch.items()
                                                                             if k not in own})


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


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], dict[str, nn.Parameter]]:
    """(dense parameters, embedding-table parameters by `"<collection path>.<table name>"`)."""
    tables: dict[str, nn.Parameter] = {}
    for path, collection in embedding_collections(model).items():
        for name, param in collection.weights.items():
            tables[f"{path}.{name}"] = param
    table_ids = {id(p) for p in tables.values()}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    return dense, tables


def replace_module(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put `new` where the submodule at dotted `path` was (e.g. a sharded collection)."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, new)


__all__ = ["DCNv2", "DLRM", "DeepFM", "MODELS", "ModelSpec", "RankingModel", "WideDeep", "build_model",
           "embedding_collections", "register", "replace_module", "spec_of", "split_parameters"]
