"""A training run written down: `--config FILE|PRESET` (YAML or JSON), named presets, overrides.

A config file holds any part of `TrainConfig.to_dict()`: top-level fields (`epochs`, `precision`, ...)
and the sections `data`, `model` and `optim`, e.g.

    model: {name: dcnv2, embedding_dim: 64, deep_mlp: [512, 256], cross_rank: 64, dropout: 0.1}
    optim: {lr: 0.002, weight_decay: 1.0e-5}

The `model` section is flat: the common fields and the settings of any registered model, of which
the model `name` names takes its own (`ctrflow.config.tree.ModelConfig.from_dict`). Fields left out
keep their defaults; a key that is no field, or a value of the wrong type or outside a field's
choices (`ctrflow.config.tree.choices_of`), is a one-line `UserError` naming the key and the file.
Presets are such files shipped in `ctrflow/config/presets/` (`mlperf-dlrm`), named without `.yaml`.
A checkpoint's `config.json` (`{"asked": ..., "resolved": ..., "plan": ...}`) reads as its `asked` part:
the run as it was asked for. Precedence: command-line flags over the file over the defaults.
`to_yaml` writes a whole config that `load_config` reads back equal.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from ctrflow.config.tree import TrainConfig, choices_of, section_types
from ctrflow.errors import UserError

PRESETS_DIR = Path(__file__).parent / "presets"


def preset_names() -> list[str]:
    """The presets shipped with ctrflow (`--config NAME`)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def read_config(source: str) -> dict[str, Any]:
    """The nested dict a config file or preset holds, every key and value checked (module doc)."""
    path = Path(source)
    if not path.is_file() and source in preset_names():
        path = PRESETS_DIR / f"{source}.yaml"
    if not path.is_file():
        raise UserError(f"--config {source}: no such file or preset (presets: {', '.join(preset_names())})")
    raw = parse_file(path)
    raw = {} if raw is None else raw
    if isinstance(raw, dict) and isinstance(raw.get("asked"), dict) and "resolved" in raw:
        raw = raw["asked"]  # a checkpoint's config.json: the run as asked for
    return check_config(raw, str(path))


def parse_file(path: Path) -> Any:
    """What the YAML or JSON file `path` holds (JSON by its `.json` suffix); a syntax error is one
    `UserError` naming the file, line and column."""
    text = path.read_text()
    if path.suffix != ".json":
        return _parse_yaml(text, path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: line {err.lineno}, column {err.colno}: {err.msg}") from None


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        import yaml  # only config files and presets need it: training itself runs without PyYAML
    except ImportError:
        raise UserError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or write the config as JSON") \
            from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise UserError(f"{path}: {where}{getattr(err, 'problem', None) or err}") from None


def check_config(raw: Any, where: str, cls: type = TrainConfig, prefix: str = "") -> dict[str, Any]:
    """`raw` with every key a field of `cls` (nested sections by their dataclass) and every value of
    its field's type (lists of widths become tuples); UserError naming the first that is not."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: {prefix.rstrip('.') or 'the config'} must be a mapping of fields, "
                        f"got {type(raw).__name__}")
    hints = section_types(cls)
    known = set(hints)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise UserError(f"{where}: unknown key {name!r} (fields here: {', '.join(sorted(known))})")
        hint = hints[key]
        if is_dataclass(hint):
            out[key] = check_config(value, where, hint, f"{name}.")
        else:
            out[key] = check_value(value, hint, name, where)
    return out


def check_value(value: Any, hint: Any, name: str, where: str) -> Any:
    """`value` as field `name` of type `hint` takes it (ints pass as floats; lists as tuples)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"{where}: {name} may not be null")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            allowed = choices_of(name)
            if allowed is not None and value not in allowed:
                raise UserError(f"{where}: {name} must be one of {', '.join(allowed)}, got {value!r}")
            return value
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)) and \
                all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            return tuple(value)
    wanted = " or ".join(_type_name(o) for o in options if o is not type(None))
    raise UserError(f"{where}: {name} must be {wanted}, got {value!r}")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "a list of positive integers"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` with `update`'s values over it, section by section."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """`{"model.name": "dcnv2", "epochs": 2}` -> `{"model": {"name": "dcnv2"}, "epochs": 2}`."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, leaf = key.rpartition(".")
        (out.setdefault(section, {}) if section else out)[leaf] = value
    return out


def load_config(source: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config of file or preset `source` (None: the defaults) with `overrides` (dotted keys, e.g.
    `{"model.dropout": 0.1}`, checked as the file is) over it."""
    raw = read_config(source) if source else {}
    flat = nest(overrides or {})
    return TrainConfig.from_dict(merge(raw, check_config(flat, "command line")))


def to_yaml(config: TrainConfig) -> str:
    """The whole `config` as YAML (sections as blocks, widths as flow lists): `load_config` of it is
    `config` again."""
    import yaml

    class Dumper(yaml.SafeDumper):
        """Block mappings, flow lists: `bottom_mlp: [512, 256]`."""

    Dumper.add_representer(tuple, lambda dumper, value: dumper.represent_sequence(
        "tag:yaml.org,2002:seq", list(value), flow_style=True))
    return yaml.dump(config.to_dict(), Dumper=Dumper, sort_keys=False, default_flow_style=False)


__all__ = ["PRESETS_DIR", "check_config", "check_value", "load_config", "merge", "nest", "preset_names",
           "read_config", "to_yaml"]
