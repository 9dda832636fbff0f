"""The search space file: which config fields a study varies, and over what.

A YAML (or JSON) mapping keyed by config field — a leaf name (`lr`, `embedding_dim`, `dropout`,
`batch_size`, `dense`, `deep_mlp`, ...) or a dotted path (`optim.lr`) where a leaf name is ambiguous —
to a range or a list of choices:

    lr: {low: 0.0003, high: 0.01, log: true}      # float range, log scale
    embedding_dim: {choices: [8, 16, 32]}
    batch_size: {low: 512, high: 4096, step: 512} # int range (the field takes ints)
    deep_mlp: {choices: [[128, 64], [256, 128]]}  # MLP widths: choices of lists
    dense: {choices: [adam, adamw]}               # the dense optimizer
    freq_threshold: {low: 6, high: 20}            # not a config field: the data's (ctrflow.tune.view)

A range is int when the field takes ints (its bounds and step must then be integers) and float when it
takes floats, whatever the bounds are written as: `{low: 0, high: 1}` for `dropout` ranges over
[0, 1], not over {0, 1}. Every bound and choice is checked as `--config` checks the field's values
(type, `ctrflow.config.choices_of`). Fields the tuner sets itself (`out`, `data.path`, `resume`, ...)
cannot be searched.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any

from ctrflow.config.tree import TrainConfig, section_types
from ctrflow.config.files import check_value, parse_file
from ctrflow.errors import UserError

THRESHOLD = "freq_threshold"  # the data's frequency threshold: a view of the processed data per value
FIXED = ("out", "data.path", "resume", "overwrite", "progress", "plan")  # set by the tuner, or per machine
RANGE_KEYS = {"low", "high", "log", "step"}


@dataclass(frozen=True)
class Param:
    """One searched field: a range (`low`..`high`, `log`, `step`) or `choices`."""

    key: str  # dotted config path (`optim.lr`), or `freq_threshold`
    kind: str  # int | float | choice
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def distribution(self):
        """The Optuna distribution this parameter is sampled from (list choices as "W,W" strings:
        Optuna's categorical values are scalars)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choice":
            return CategoricalDistribution([encode_choice(c) for c in self.choices])
        if self.kind == "int":
            return IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def value(self, sampled: Any) -> Any:
        """The config value of an Optuna-sampled value (a "W,W" string back to a tuple of widths)."""
        if self.kind == "choice" and isinstance(sampled, str) and any(isinstance(c, tuple) for c in self.choices):
            return next(c for c in self.choices if encode_choice(c) == sampled)
        return sampled

    def describe(self) -> dict[str, Any]:
        """The file's entry for this parameter, normalized (a study records it to refuse another space)."""
        if self.kind == "choice":
            return {"choices": [list(c) if isinstance(c, tuple) else c for c in self.choices]}
        out = {"low": self.low, "high": self.high, "log": self.log}
        return {**out, "step": self.step} if self.step is not None else out


@dataclass(frozen=True)
class SearchSpace:
    """The searched parameters of a study, in file order."""

    params: tuple[Param, ...]
    source: str = ""

    @property
    def distributions(self) -> dict[str, Any]:
        """`{key: optuna distribution}`: what `study.ask` samples."""
        return {p.key: p.distribution() for p in self.params}

    def values(self, sampled: dict[str, Any]) -> dict[str, Any]:
        """`{dotted key: config value}` of a trial's sampled params (`freq_threshold` included)."""
        return {p.key: p.value(sampled[p.key]) for p in self.params if p.key in sampled}

    def threshold(self) -> Param | None:
        """The `freq_threshold` parameter, if the space has one."""
        return next((p for p in self.params if p.key == THRESHOLD), None)

    def describe(self) -> dict[str, Any]:
        """`{key: entry}`: the space as a plain dict."""
        return {p.key: p.describe() for p in self.params}


def encode_choice(choice: Any) -> Any:
    """A choice as Optuna stores it: widths (128, 64) as "128,64", scalars as they are."""
    return ",".join(str(v) for v in choice) if isinstance(choice, (tuple, list)) else choice


def config_fields() -> dict[str, Any]:
    """`{dotted key: type hint}` of every `TrainConfig` field (sections flattened; the model section's
    settings of every registered model)."""
    out: dict[str, Any] = {}

    def walk(cls, prefix: str) -> None:
        for name, hint in section_types(cls).items():
            if is_dataclass(hint):
                walk(hint, f"{prefix}{name}.")
            else:
                out[f"{prefix}{name}"] = hint

    walk(TrainConfig, "")
    return out


def resolve_key(key: str, known: dict[str, Any], where: str) -> str:
    """The dotted config path a space key names (a leaf name or a dotted path); UserError otherwise."""
    if key == THRESHOLD:
        return key
    if key in known:
        found = [key]
    else:
        found = [k for k in known if k.rsplit(".", 1)[-1] == key]
    if not found:
        raise UserError(f"{where}: unknown field {key!r} (a config field like lr, optim.lr, embedding_dim, "
                        f"or {THRESHOLD}; `ctrflow train --print-config` lists them)")
    if len(found) > 1:
        raise UserError(f"{where}: {key!r} is ambiguous: write one of {', '.join(found)}")
    if found[0] in FIXED:
        raise UserError(f"{where}: {found[0]} is set by ctrflow tune itself and cannot be searched")
    return found[0]


def read_space(path: str | Path) -> SearchSpace:
    """The search space in file `path` (YAML or JSON), every entry checked (module doc)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--space {path}: no such file")
    return parse_space(parse_file(path), str(path))


def parse_space(raw: Any, where: str) -> SearchSpace:
    """The search space of the mapping `raw` (as read from file `where`)."""
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{where}: a search space is a mapping of config fields to ranges or choices, "
                        f"e.g. `lr: {{low: 0.0003, high: 0.01, log: true}}`")
    known = config_fields()
    params, seen = [], {}
    for key, entry in raw.items():
        dotted = resolve_key(str(key), known, where)
        if dotted in seen:
            raise UserError(f"{where}: {key!r} and {seen[dotted]!r} name the same field {dotted}")
        seen[dotted] = key
        hint = int if dotted == THRESHOLD else known[dotted]
        params.append(_param(dotted, hint, entry, f"{where}: {key}"))
    return SearchSpace(tuple(params), where)


def _param(key: str, hint: Any, entry: Any, where: str) -> Param:
    if not isinstance(entry, dict):
        raise UserError(f"{where}: expected {{low: ..., high: ...}} or {{choices: [...]}}, got {entry!r}")
    if "choices" in entry:
        extra = set(entry) - {"choices"}
        if extra:
            raise UserError(f"{where}: choices take no {', '.join(sorted(extra))}")
        choices = entry["choices"]
        if not isinstance(choices, list) or not choices:
            raise UserError(f"{where}: choices must be a non-empty list, got {choices!r}")
        checked = tuple(check_value(c, hint, key, where.rsplit(":", 1)[0]) for c in choices)
        if len({encode_choice(c) for c in checked}) != len(checked):
            raise UserError(f"{where}: choices repeat a value: {choices!r}")
        if key == THRESHOLD and min(checked) < 1:
            raise UserError(f"{where}: thresholds are at least 1, got {min(checked)}")
        return Param(key, "choice", choices=checked)
    unknown = set(entry) - RANGE_KEYS
    if unknown or not {"low", "high"} <= set(entry):
        raise UserError(f"{where}: a range is {{low, high[, log][, step]}} and choices are {{choices: [...]}}, "
                        f"got keys {', '.join(sorted(map(str, entry)))}")
    kind = _range_kind(hint, key, where)
    low, high, step = entry["low"], entry["high"], entry.get("step")
    log = entry.get("log", False)
    for name, value in (("low", low), ("high", high), ("step", step)):
        if value is None and name == "step":
            continue
        ok = isinstance(value, int) if kind == "int" else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            raise UserError(f"{where}: {name} must be {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
    if not isinstance(log, bool):
        raise UserError(f"{where}: log must be true or false, got {log!r}")
    if low > high:
        raise UserError(f"{where}: empty range: low {low} > high {high}")
    if log and low <= 0:
        raise UserError(f"{where}: a log range needs low > 0, got {low}")
    if step is not None and (step <= 0 or log):
        raise UserError(f"{where}: step must be > 0 and cannot go with log, got step {step}")
    if key == THRESHOLD and low < 1:
        raise UserError(f"{where}: thresholds are at least 1, got low {low}")
    if kind == "float":
        low, high, step = float(low), float(high), None if step is None else float(step)
    return Param(key, kind, low=low, high=high, log=log, step=step)


def _range_kind(hint: Any, key: str, where: str) -> str:
    options = set(typing.get_args(hint)) if typing.get_args(hint) else {hint}
    if float in options:
        return "float"
    if int in options:
        return "int"
    raise UserError(f"{where}: {key} takes no numbers from a range; give {{choices: [...]}}")


__all__ = ["FIXED", "Param", "SearchSpace", "THRESHOLD", "config_fields", "encode_choice", "parse_space",
           "read_space", "resolve_key"]
