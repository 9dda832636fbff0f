"""A dataset description: which columns of a table are the label, dense, categorical and multi-hot features.

One YAML or JSON file says everything preprocessing, serving and `ctrflow predict` need to read raw rows:

```yaml
name: movies               # optional: the file's stem
format: csv                # csv | tsv | parquet (csv/tsv may be gzip)
header: true               # csv/tsv: the first line names the columns (false: `columns` lists them in order)
delimiter: ","             # csv/tsv: one character (csv "," and tsv a tab by default)
quote: '"'                 # csv/tsv: the quote character, or none (csv '"', tsv none by default)
label: liked               # a 0/1 column
dense: [year, price]       # numbers: missing -> 0, then `transform`
categorical: [userId, movieId]   # any string or integer values; "" = missing
multi_hot:                 # a list of values per row: up to max_length ids, padded with 0
  genres: {separator: "|", max_length: 10, pooling: sum, keep: first}   # parquet: a list column
freq_threshold: {default: 6, userId: 2}   # or one number: occurrences a value needs for its own id
transform: log1p           # dense: log1p (negatives -> 0 first; the default) | none, or {default: ..., year: none}
dense_type: float          # float | integer: integer makes a value with a fraction a bad row
```

A multi-hot column's keys default to `separator: "|"`, `pooling: sum` (or mean), `keep: first` (a longer
list keeps its first max_length values; `last`: its last ones), and `max_length` to the longest list of
the training rows (`with_max_lengths` fills it in once they are read; schema.json records it).
Columns the description does not name are ignored. Everything is checked before any data is read:
an unknown key, a column given two roles, a bad value, or (`check_columns`) a column missing from the
file, raises a one-line `UserError` naming the key or column and the description file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ctrflow.errors import UserError
from ctrflow.contract.features import LABEL, POOLINGS, TRANSFORMS, Feature, Features
from ctrflow.contract.lists import KEEPS

FORMATS = ("csv", "tsv", "parquet")
DENSE_TYPES = ("float", "integer")
DEFAULT_THRESHOLD = 6
_KEYS = ("name", "format", "header", "delimiter", "quote", "columns", "label", "dense", "categorical", "multi_hot",
         "freq_threshold", "transform", "dense_type")
_TEXT_ONLY = ("header", "delimiter", "quote", "columns")  # keys of csv/tsv only
_MULTI_HOT_KEYS = ("separator", "max_length", "pooling", "keep")
_OTHER_DELIMITERS = (("\t", "tabs", "tsv"), (",", "commas", "csv"), (";", "semicolons", ""), ("|", "pipes", ""))


@dataclass(frozen=True)
class MultiHot:
    """How one multi-hot column is read: `separator` between values in text, up to `max_length` kept (None:
    the longest training list's length, not yet known), the first or the last ones (`keep`)."""

    separator: str = "|"
    max_length: int | None = None
    pooling: str = "sum"
    keep: str = "first"


@dataclass(frozen=True)
class Description:
    """A checked dataset description (see the module docstring); `source` names where it came from."""

    format: str
    label: str
    dense: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    multi_hot: dict[str, MultiHot] = field(default_factory=dict)
    header: bool = True
    delimiter: str = ","
    quote: str | None = '"'
    columns: tuple[str, ...] | None = None  # csv/tsv without a header: every column of the file, in order
    thresholds: dict[str, int] = field(default_factory=dict)  # per sparse feature, beside the default
    default_threshold: int = DEFAULT_THRESHOLD
    transforms: dict[str, str] = field(default_factory=dict)  # per dense feature, beside the default
    default_transform: str = "log1p"
    dense_type: str = "float"
    name: str = "dataset"
    source: str = "<description>"

    @property
    def sparse(self) -> tuple[str, ...]:
        """Categorical then multi-hot columns: the sparse features, in batch order."""
        return (*self.categorical, *self.multi_hot)

    @property
    def raw_columns(self) -> tuple[str, ...]:
        """The columns a raw row must carry for the model: dense, categorical, multi-hot (no label)."""
        return (*self.dense, *self.sparse)

    @property
    def used_columns(self) -> tuple[str, ...]:
        """The label and every feature column: what preprocessing reads of a file."""
        return (self.label, *self.raw_columns)

    def threshold(self, column: str, default: int | None = None) -> int:
        """The frequency threshold of a sparse column (`default` overrides the description's default)."""
        return self.thresholds.get(column, self.default_threshold if default is None else default)

    def transform(self, column: str) -> str:
        """The transform of a dense column: log1p | none."""
        return self.transforms.get(column, self.default_transform)

    def features(self, cardinalities: Mapping[str, int]) -> Features:
        """The feature contract of the processed data, given each sparse feature's vocabulary size + 2."""
        dense = tuple(Feature(c, "dense", transform=self.transform(c)) for c in self.dense)
        sparse = [Feature(c, "categorical", cardinality=int(cardinalities[c])) for c in self.categorical]
        sparse += [Feature(c, "multi_hot", cardinality=int(cardinalities[c]), max_length=m.max_length,
                           pooling=m.pooling) for c, m in self.multi_hot.items()]
        return Features(dense=dense, sparse=tuple(sparse))

    def check_columns(self, available: Sequence[str], where: str) -> None:
        """A one-line UserError unless every column the description names is in `available` (a file's
        header or Parquet schema, described by `where`)."""
        have = set(available)
        for column in self.used_columns:
            if column not in have:
                shown = ", ".join(list(available)[:12]) + (", ..." if len(available) > 12 else "")
                hint = self.delimiter_hint(available)
                raise UserError(f"{self.source}: column {column!r} ({self.role(column)}) is not in {where}"
                                + (f": {hint}" if hint else f" (its columns: {shown})"))

    def delimiter_hint(self, names: Sequence[str]) -> str:
        """What to set when a header's names hold another delimiter than the description's (a CSV description
        on a TSV file, ...), else ""."""
        if self.format == "parquet":
            return ""
        for delimiter, what, fmt in _OTHER_DELIMITERS:
            if delimiter != self.delimiter and any(delimiter in name for name in names):
                guess = f"is the file {fmt.upper()}? set format: {fmt} or " if fmt else ""
                return f"the header holds {what}: {guess}set delimiter: {delimiter!r}"
        return ""

    def role(self, column: str) -> str:
        """label | dense | categorical | multi_hot | "" (not named)."""
        if column == self.label:
            return "label"
        for role in ("dense", "categorical", "multi_hot"):
            if column in getattr(self, role):
                return role
        return ""

    def to_dict(self) -> dict[str, Any]:
        """The description with every default filled in (what schema.json's `dataset` holds); `from_dict`
        reads it back."""
        raw: dict[str, Any] = {"name": self.name, "format": self.format}
        if self.format != "parquet":
            raw.update(header=self.header, delimiter=self.delimiter, quote=self.quote)
            if self.columns is not None:
                raw["columns"] = list(self.columns)
        raw.update(label=self.label, dense=list(self.dense), categorical=list(self.categorical),
                   multi_hot={c: {"separator": m.separator, "max_length": m.max_length, "pooling": m.pooling,
                                  "keep": m.keep} for c, m in self.multi_hot.items()},
                   freq_threshold={"default": self.default_threshold, **self.thresholds},
                   transform={"default": self.default_transform, **self.transforms}, dense_type=self.dense_type)
        return raw

    def with_max_lengths(self, lengths: Mapping[str, int]) -> "Description":
        """The description with each multi-hot column's unset max_length taken from `lengths`."""
        filled = {c: m if m.max_length is not None else replace(m, max_length=int(lengths[c]))
                  for c, m in self.multi_hot.items()}
        return replace(self, multi_hot=filled)

    @classmethod
    def from_dict(cls, raw: Any, source: str = "<description>", name: str | None = None) -> "Description":
        """Check a parsed description (a mapping); every problem is a one-line UserError naming `source`."""
        return _parse(raw, source, name)


def load_description(path: str | os.PathLike) -> Description:
    """Read and check a YAML or JSON description file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such dataset description file (or give --dataset criteo)")
    import yaml

    text = path.read_text(encoding="utf-8", errors="replace")
    is_json = path.suffix.lower() == ".json"
    try:
        raw = json.loads(text) if is_json else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        first = str(err).strip().splitlines()
        raise UserError(f"{path}: not valid {'JSON' if is_json else 'YAML'} "
                        f"({first[0] if first else type(err).__name__})") from None
    return _parse(raw, str(path), path.stem)


def _parse(raw: Any, source: str, name: str | None) -> Description:
    def fail(what: str):
        raise UserError(f"{source}: {what}")

    if not isinstance(raw, Mapping):
        fail("a dataset description is a mapping of keys (format, label, dense, categorical, multi_hot, ...)")
    unknown = [k for k in raw if k not in _KEYS]
    if unknown:
        fail(f"unknown key {unknown[0]!r} (known: {', '.join(_KEYS)})")
    fmt = raw.get("format")
    if fmt not in FORMATS:
        fail(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "parquet":
        extra = [k for k in _TEXT_ONLY if k in raw]
        if extra:
            fail(f"{extra[0]}: only for csv/tsv (a Parquet file names and types its own columns)")
    header = raw.get("header", True)
    if not isinstance(header, bool):
        fail(f"header: must be true or false, got {header!r}")
    delimiter = raw.get("delimiter", "\t" if fmt == "tsv" else ",")
    quote = raw.get("quote", None if fmt == "tsv" else '"')
    if quote in (False, "", "none"):
        quote = None
    for key, value in (("delimiter", delimiter), ("quote", quote)):
        if value is not None and (not isinstance(value, str) or len(value) != 1 or value in "\r\n"):
            fail(f"{key}: must be one character (not a newline), got {value!r}")
    if quote is not None and quote == delimiter:
        fail(f"quote: must differ from the delimiter ({delimiter!r})")
    columns = raw.get("columns")
    if fmt != "parquet":
        if header and columns is not None:
            fail("columns: only with header: false (the header names the columns)")
        if not header and columns is None:
            fail("columns: required with header: false (every column of the file, in order)")
    if columns is not None:
        columns = tuple(_names(columns, "columns", fail))
        twice = sorted({c for c in columns if columns.count(c) > 1})
        if twice:
            fail(f"columns: {twice[0]!r} is listed twice")
    label = raw.get("label")
    if not isinstance(label, str) or not label:
        fail(f"label: must name the 0/1 column, got {label!r}")
    dense = tuple(_names(raw.get("dense", []), "dense", fail))
    categorical = tuple(_names(raw.get("categorical", []), "categorical", fail))
    multi_hot = _multi_hot(raw.get("multi_hot", {}) or {}, fmt, fail)
    _check_roles(label, dense, categorical, tuple(multi_hot), columns, fail)
    if not (dense or categorical or multi_hot):
        fail("no feature: name at least one dense, categorical or multi_hot column")
    default_threshold, thresholds = _per_column(raw.get("freq_threshold", DEFAULT_THRESHOLD), "freq_threshold",
                                                (*categorical, *multi_hot), DEFAULT_THRESHOLD, _threshold, fail)
    default_transform, transforms = _per_column(raw.get("transform", "log1p"), "transform", dense, "log1p",
                                                _transform, fail)
    dense_type = raw.get("dense_type", "float")
    if dense_type not in DENSE_TYPES:
        fail(f"dense_type: must be one of {', '.join(DENSE_TYPES)}, got {dense_type!r}")
    given_name = raw.get("name", name or "dataset")
    if not isinstance(given_name, str) or not given_name:
        fail(f"name: must be a non-empty string, got {given_name!r}")
    return Description(format=fmt, label=label, dense=dense, categorical=categorical, multi_hot=multi_hot,
                       header=header if fmt != "parquet" else True, delimiter=delimiter, quote=quote, columns=columns,
                       thresholds=thresholds, default_threshold=default_threshold, transforms=transforms,
                       default_transform=default_transform, dense_type=dense_type, name=given_name, source=source)


def _names(value: Any, key: str, fail) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        fail(f"{key}: must be a list of column names, got {value!r}")
    names = []
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool):
            item = str(item)  # YAML reads a column named 2019 as a number
        if not isinstance(item, str) or not item:
            fail(f"{key}: column names are non-empty strings, got {item!r}")
        if "/" in item or "\\" in item or item in (".", "..") or "\x00" in item:
            fail(f"{key}: column {item!r}: a feature's vocabulary file is named after it; "
                 "use a name without slashes")
        names.append(item)
    return names


def _multi_hot(value: Any, fmt: str, fail) -> dict[str, MultiHot]:
    if not isinstance(value, Mapping):
        fail(f"multi_hot: must map column names to {{{', '.join(_MULTI_HOT_KEYS)}}}, got {value!r}")
    found = {}
    for column, options in value.items():
        column = _names([column], "multi_hot", fail)[0]
        options = options or {}
        if not isinstance(options, Mapping):
            fail(f"multi_hot: {column}: must be a mapping of {', '.join(_MULTI_HOT_KEYS)}")
        unknown = [k for k in options if k not in _MULTI_HOT_KEYS]
        if unknown:
            fail(f"multi_hot: {column}: unknown key {unknown[0]!r} (known: {', '.join(_MULTI_HOT_KEYS)})")
        separator = options.get("separator", "|")
        if not isinstance(separator, str) or not separator or "\n" in separator:
            fail(f"multi_hot: {column}: separator must be a non-empty string, got {separator!r}")
        length = options.get("max_length")
        if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
            fail(f"multi_hot: {column}: max_length must be a positive integer (or left out: the longest "
                 f"training list), got {length!r}")
        pooling = options.get("pooling", "sum")
        if pooling not in POOLINGS:
            fail(f"multi_hot: {column}: pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        keep = options.get("keep", "first")
        if keep not in KEEPS:
            fail(f"multi_hot: {column}: keep must be one of {', '.join(KEEPS)}, got {keep!r}")
        found[column] = MultiHot(separator, length, pooling, keep)
    return found


def _check_roles(label, dense, categorical, multi_hot, columns, fail) -> None:
    seen: dict[str, str] = {label: "label"}
    for role, names in (("dense", dense), ("categorical", categorical), ("multi_hot", multi_hot)):
        for name in names:
            if name in seen:
                where = "twice in " + role if seen[name] == role else f"both {seen[name]} and {role}"
                fail(f"column {name!r} is {where}: give each column one role")
            seen[name] = role
    if LABEL in seen and label != LABEL:
        fail(f"column {LABEL!r} is a {seen[LABEL]} feature: that name is the processed label's; "
             "rename the column (or make it the label)")
    if columns is not None:
        missing = [name for name in seen if name not in columns]
        if missing:
            fail(f"column {missing[0]!r} ({seen[missing[0]]}) is not in columns")


def _threshold(value: Any, key: str, fail) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        fail(f"{key}: must be a positive integer, got {value!r}")
    return value


def _transform(value: Any, key: str, fail) -> str:
    if value not in TRANSFORMS:
        fail(f"{key}: must be one of {', '.join(TRANSFORMS)}, got {value!r}")
    return value


def _per_column(value: Any, key: str, allowed: Sequence[str], default: Any, check, fail) -> tuple[Any, dict]:
    """One value for every column, or {default: v, column: v, ...} for the named ones."""
    if not isinstance(value, Mapping):
        return check(value, key, fail), {}
    per_column = {}
    for column, item in value.items():
        column = str(column)
        if column == "default":
            default = check(item, f"{key}: default", fail)
        elif column not in allowed:
            fail(f"{key}: {column!r} is not a {'sparse' if key == 'freq_threshold' else 'dense'} column "
                 f"of this description")
        else:
            per_column[column] = check(item, f"{key}: {column}", fail)
    return default, per_column


__all__ = ["DENSE_TYPES", "DEFAULT_THRESHOLD", "Description", "FORMATS", "MultiHot", "load_description"]
