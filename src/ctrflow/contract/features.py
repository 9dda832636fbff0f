"""The feature contract: what a processed dataset gives a model, read from `schema.json`.

A dataset has one 0/1 label, `dense` numeric features and `sparse` id features:
- categorical: one id per row; 0 = missing, 1 = rare or unseen (OOV), 2.. = the vocabulary
  (values seen at least the threshold's count in the training split, most frequent first, ties by value);
- multi-hot: up to `max_length` ids per row with the same id rule, padded with 0; padding
  contributes nothing, and the looked-up vectors are pooled by `sum` or `mean`.

Rows reach a model as a `Batch`: dense [B, num_dense] float32, and sparse [B, slots] ids in which
each sparse feature occupies `width` consecutive slots (1 for categorical, `max_length` for
multi-hot), in feature order. Parquet holds the same: `label` (float32), one float32 column per
dense feature, one int32 column per categorical feature, one `fixed_size_list<int32>[max_length]`
column per multi-hot feature.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

from ctrflow.errors import UserError

LABEL = "label"  # the label's column name in processed Parquet, whatever the raw column was called
MISSING_ID = 0  # empty field (categorical); padding (multi-hot)
PADDING_ID = MISSING_ID
OOV_ID = 1  # rare in the training split, or unseen there
FIRST_ID = 2  # most frequent value; ids then follow descending frequency, ties by value

KINDS = ("dense", "categorical", "multi_hot")
POOLINGS = ("sum", "mean")
TRANSFORMS = ("log1p", "none")  # dense: log1p(max(x, 0)) | x as is; missing -> 0 either way


@dataclass(frozen=True)
class Feature:
    """One model input. `cardinality` (sparse kinds): vocabulary + 2, the embedding table's rows."""

    name: str
    kind: str
    cardinality: int = 0
    max_length: int = 1  # multi-hot: ids per row, padded with 0
    pooling: str | None = None  # multi-hot: sum | mean
    transform: str | None = None  # dense: log1p | none

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"feature {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "multi_hot" and self.pooling not in POOLINGS:
            raise UserError(f"feature {self.name}: pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.kind == "dense" and self.transform not in TRANSFORMS:
            raise UserError(f"feature {self.name}: transform must be one of {', '.join(TRANSFORMS)}, "
                            f"got {self.transform!r}")
        if self.max_length < 1:
            raise UserError(f"feature {self.name}: max_length must be at least 1, got {self.max_length}")

    @property
    def width(self) -> int:
        """Slots this feature takes in a batch's sparse ids (0 for dense features)."""
        if self.kind == "dense":
            return 0
        return self.max_length if self.kind == "multi_hot" else 1

    def to_json(self) -> dict[str, Any]:
        """Only the keys that mean something for this kind."""
        raw = asdict(self)
        if self.kind == "dense":
            keep = ("name", "kind", "transform")
        elif self.kind == "categorical":
            keep = ("name", "kind", "cardinality")
        else:
            keep = ("name", "kind", "cardinality", "max_length", "pooling")
        return {k: raw[k] for k in keep}


@dataclass(frozen=True)
class Features:
    """The label, the dense features and the sparse features, in the order a batch holds them."""

    dense: tuple[Feature, ...]
    sparse: tuple[Feature, ...]
    label: str = LABEL

    def __post_init__(self) -> None:
        names = [f.name for f in (*self.dense, *self.sparse)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"feature {twice[0]} appears twice")
        if LABEL in names:
            raise UserError(f"feature name {LABEL!r} is reserved for the label")
        if any(f.kind != "dense" for f in self.dense) or any(f.kind == "dense" for f in self.sparse):
            raise UserError("dense and sparse features are listed apart")

    @property
    def num_dense(self) -> int:
        """Dense inputs of a batch: `dense` [B, num_dense]."""
        return len(self.dense)

    @property
    def slots(self) -> int:
        """Ids per row of a batch: `sparse` [B, slots]."""
        return sum(f.width for f in self.sparse)

    @property
    def one_hot(self) -> bool:
        """Every sparse feature takes one slot (no multi-hot feature)."""
        return all(f.kind == "categorical" for f in self.sparse)

    def slot_spans(self) -> list[tuple[int, int]]:
        """[start, stop) of each sparse feature's slots, in feature order."""
        spans, start = [], 0
        for f in self.sparse:
            spans.append((start, start + f.width))
            start += f.width
        return spans

    def table_sizes(self) -> list[int]:
        """Cardinalities of the sparse features, in order: the embedding table sizes."""
        return [f.cardinality for f in self.sparse]

    def cardinalities(self) -> dict[str, int]:
        """`{name: cardinality}` of the sparse features (schema.json's `cardinalities`)."""
        return {f.name: f.cardinality for f in self.sparse}

    def names(self) -> list[str]:
        """Dense then sparse feature names: the Parquet columns after `label`."""
        return [f.name for f in (*self.dense, *self.sparse)]

    def to_json(self) -> dict[str, Any]:
        """`{"label": ..., "dense": [...], "sparse": [...]}` (what schema.json's `features` holds)."""
        return {"label": self.label, "dense": [f.to_json() for f in self.dense],
                "sparse": [f.to_json() for f in self.sparse]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "Features":
        """Inverse of `to_json`; a malformed entry is a `UserError` naming it."""
        try:
            return cls(dense=tuple(_feature(f) for f in raw.get("dense", ())),
                       sparse=tuple(_feature(f) for f in raw.get("sparse", ())), label=raw.get("label", LABEL))
        except (TypeError, AttributeError) as err:
            raise UserError(f"features: malformed entry ({err})") from None

    @classmethod
    def categorical(cls, cardinalities: Mapping[str, int] | Sequence[int], dense: Iterable[str] | int = (),
                    transform: str = "log1p") -> "Features":
        """One-hot features only: `cardinalities` by name (or a list, named `C1`, `C2`, ...), and
        dense features by name (or a count, named `I1`, `I2`, ...)."""
        if not isinstance(cardinalities, Mapping):
            cardinalities = {f"C{i + 1}": int(n) for i, n in enumerate(cardinalities)}
        names = [f"I{i + 1}" for i in range(dense)] if isinstance(dense, int) else list(dense)
        return cls(dense=tuple(Feature(n, "dense", transform=transform) for n in names),
                   sparse=tuple(Feature(n, "categorical", cardinality=int(c)) for n, c in cardinalities.items()))


def _feature(raw: Mapping[str, Any]) -> Feature:
    known = set(Feature.__dataclass_fields__)
    return Feature(**{k: v for k, v in raw.items() if k in known})


__all__ = ["FIRST_ID", "Feature", "Features", "KINDS", "LABEL", "MISSING_ID", "OOV_ID", "PADDING_ID", "POOLINGS",
           "TRANSFORMS"]
