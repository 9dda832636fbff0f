"""`schema.json`: what a processed dataset holds, written once by preprocess and read by every later step.

It carries the feature contract (`ctrflow.contract.features.Features`: label, dense and sparse features with
their vocabulary sizes, max lengths, pooling and transforms) and the dataset description it came
from, with the split sizes, the input files and a hash of the vocabularies. Schemas written before
`features` existed (one-hot features only) still load: their features are read off `columns`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ctrflow.errors import UserError
from ctrflow.contract.features import FIRST_ID, LABEL, MISSING_ID, OOV_ID, Feature, Features  # noqa: F401 (re-exported)

DENSE_TRANSFORM = "log1p(max(x, 0)), missing -> 0"


@dataclass(frozen=True)
class Schema:
    """What a processed dataset holds; written once by preprocess, read by every later step."""

    cardinalities: dict[str, int]  # vocabulary size + 2 (missing, OOV) per sparse feature
    freq_threshold: int  # the default threshold (per-feature ones are in `dataset`)
    rows: dict[str, int]  # {"train": n, "valid": n}
    vocab_hash: str  # sha256 over the vocabularies, so a checkpoint can tell its data
    files: list[dict] = field(default_factory=list)  # input files: path, bytes, digest, split
    dense_transform: str = DENSE_TRANSFORM
    columns: dict[str, str] = field(default_factory=dict)  # Parquet column -> dtype
    features: Features | None = None  # None: read off `columns` and `cardinalities` (one-hot, log1p)
    dataset: dict[str, Any] = field(default_factory=dict)  # the dataset description preprocess was given
    label_rate: float | None = None  # mean label of the training split (a model's starting bias)
    # `--vocab-from`: the processed data whose vocabularies these extend ({vocab_hash, path, cardinalities});
    # None (not written) for vocabularies made from scratch
    parent: dict[str, Any] | None = None
    version: int = 2

    def __post_init__(self) -> None:
        if self.features is None:
            object.__setattr__(self, "features", _features_from_columns(self.columns, self.cardinalities))
        elif isinstance(self.features, dict):
            object.__setattr__(self, "features", Features.from_json(self.features))
        if not self.columns:
            object.__setattr__(self, "columns", parquet_columns(self.features))

    def save(self, path: str | os.PathLike) -> None:
        """Write `schema.json` atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        raw = {**asdict(self), "features": self.features.to_json()}
        if raw["parent"] is None:  # schemas without a parent read as before
            del raw["parent"]
        tmp.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Schema":
        """Read `schema.json` (a file, or a processed-data directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "schema.json"
        if not path.exists():
            raise UserError(f"{path}: no schema.json (is this a `ctrflow preprocess` output directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{path}: not valid JSON ({err})") from None
        known = set(cls.__dataclass_fields__)
        missing = [k for k in ("cardinalities", "freq_threshold", "rows", "vocab_hash") if k not in raw]
        if missing:
            raise UserError(f"{path}: missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in known})

    def table_sizes(self) -> list[int]:
        """Cardinalities of the sparse features in order: the embedding table sizes."""
        return self.features.table_sizes()

    def differences(self, other: "Schema") -> list[str]:
        """Human-readable differences that make two datasets incompatible for one model."""
        diffs = feature_differences(self.features, other.features, cardinality=True,
                                    sides=("trained on", "in the data"))
        if self.vocab_hash != other.vocab_hash:
            diffs.append(f"vocab_hash {self.vocab_hash[:12]} != {other.vocab_hash[:12]}")
        return diffs


def feature_differences(mine: Features, theirs: Features, cardinality: bool = False,
                        sides: tuple[str, str] = ("there", "here")) -> list[str]:
    """Human-readable differences between two feature sets: names, kinds, dense transforms, max lengths,
    poolings (and the cardinalities if `cardinality`; vocabularies that grow day by day differ only there).
    `sides` name the two sets in the messages."""
    diffs = [_names_differ(kind, [f.name for f in getattr(mine, kind)], [f.name for f in getattr(theirs, kind)],
                           sides) for kind in ("dense", "sparse")]
    diffs = [d for d in diffs if d]
    diffs.extend(f"{a.name} transform {a.transform} != {b.transform}" for a, b in zip(mine.dense, theirs.dense)
                 if a.name == b.name and a.transform != b.transform)
    keys = ("kind", "cardinality", "max_length", "pooling") if cardinality else ("kind", "max_length", "pooling")
    for a, b in zip(mine.sparse, theirs.sparse):
        if a.name == b.name and a != b:
            diffs.extend(f"{a.name} {k} {getattr(a, k)} != {getattr(b, k)}" for k in keys
                         if getattr(a, k) != getattr(b, k))
    return diffs


def _names_differ(kind: str, mine: list[str], theirs: list[str], sides: tuple[str, str]) -> str:
    """"" when equal; else the names only one side has (or the order), a few of each."""
    if mine == theirs:
        return ""
    if set(mine) == set(theirs):
        return f"{kind} features in another order ({', '.join(mine[:8])} != {', '.join(theirs[:8])})"

    def few(names: list[str]) -> str:
        return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "") if names else "none"

    return (f"{kind} features differ: only {sides[0]} {few([n for n in mine if n not in theirs])}; "
            f"only {sides[1]} {few([n for n in theirs if n not in mine])}")


def parquet_columns(features: Features) -> dict[str, str]:
    """Parquet column -> dtype of processed data with these features."""
    columns = {LABEL: "float32", **{f.name: "float32" for f in features.dense}}
    for f in features.sparse:
        columns[f.name] = "int32" if f.kind == "categorical" else f"fixed_size_list<int32>[{f.max_length}]"
    return columns


def _natural(name: str) -> list:
    """`C2` before `C10`: schema.json is written with sorted keys."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _features_from_columns(columns: dict[str, str], cardinalities: dict[str, int]) -> Features:
    """A schema from before `features`: float32 columns are dense (log1p), the rest one-hot."""
    dense = sorted((c for c, dtype in columns.items() if c != LABEL and dtype.startswith("float")), key=_natural)
    sparse = sorted(cardinalities, key=_natural) if not columns else \
        sorted((c for c in cardinalities if c in columns), key=_natural)
    return Features.categorical({c: int(cardinalities[c]) for c in sparse}, dense)
