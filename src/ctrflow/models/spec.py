"""The model registry: each model file registers its module class and its own settings once.

A `ModelSpec` is what the rest of ctrflow knows of a model: its name (`--model`), its class (a
`RankingModel`) and its settings class, a frozen dataclass of the fields only that model uses, each
with its default and a `help` entry in the field's metadata. `ctrflow train`'s flags, config files,
presets, `--print-config`, tuning spaces and the pipeline's model choice all read this registry.
The settings every model takes (embedding width, dropout, the tables' init scale) are
`ctrflow.config.ModelConfig`'s own fields, not a model's.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """One registered model: `name` builds `model(features, embedding_dim, settings, ...)` with
    `settings` an instance of `config`."""

    name: str
    model: type
    config: type

    def defaults(self) -> dict[str, Any]:
        """`{field: default}` of the model's own settings."""
        return asdict(self.config())


MODELS: dict[str, ModelSpec] = {}


def register(name: str, model: type, config: type) -> ModelSpec:
    """Make model `name` known to every step: `model` its class, `config` its settings dataclass.

    A setting named like another model's must have the same type (one flag and one config key set
    it for whichever of them runs); a setting needs a default (config files may leave it out)."""
    if name in MODELS:
        raise ValueError(f"model {name!r} is registered twice")
    if not is_dataclass(config):
        raise TypeError(f"model {name!r}: its settings must be a dataclass, got {config!r}")
    known = setting_types()
    for key, hint in typing.get_type_hints(config).items():
        if key in known and known[key] != hint:
            raise TypeError(f"model {name!r}: setting {key!r} is {hint}, another model's is {known[key]}")
    missing = [f.name for f in fields(config) if f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise TypeError(f"model {name!r}: settings without a default: {', '.join(missing)}")
    spec = ModelSpec(name, model, config)
    MODELS[name] = spec
    return spec


def spec_of(name: str) -> ModelSpec:
    """The registered model `name`; ValueError naming the registered ones otherwise."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


def setting_types() -> dict[str, Any]:
    """`{setting: type hint}` over every registered model's own settings, in registration order."""
    out: dict[str, Any] = {}
    for spec in MODELS.values():
        for key, hint in typing.get_type_hints(spec.config).items():
            out.setdefault(key, hint)
    return out


def setting_help(key: str) -> tuple[str, dict[str, Any]]:
    """(help text, `{model: default}`) of setting `key` across the models that have it."""
    text, defaults = "", {}
    for spec in MODELS.values():
        for f in fields(spec.config):
            if f.name == key:
                text = text or f.metadata.get("help", "")
                defaults[spec.name] = f.default if f.default is not MISSING else f.default_factory()
    return text, defaults


__all__ = ["MODELS", "ModelSpec", "register", "setting_help", "setting_types", "spec_of"]
