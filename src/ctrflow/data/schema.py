"""The feature contract between preprocess, train, evaluate, export and serving (`schema.json`)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ctrflow.errors import UserError

LABEL = "label"
DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27))
RAW_COLUMNS = (LABEL, *DENSE, *SPARSE)  # the 40-column training layout; Kaggle test drops LABEL

MISSING_ID = 0  # empty field
OOV_ID = 1  # rare in the training split, or unseen there
FIRST_ID = 2  # most frequent value; ids then follow descending frequency, ties by value

DENSE_TRANSFORM = "log1p(max(x, 0)), missing -> 0"


@dataclass(frozen=True)
class Schema:
    """What a processed dataset holds; written once by preprocess, read by every later step."""

    cardinalities: dict[str, int]  # vocabulary size + 2 (missing, OOV) per categorical column
    freq_threshold: int
    rows: dict[str, int]  # {"train": n, "valid": n}
    vocab_hash: str  # sha256 over the vocabularies, so a checkpoint can tell its data
    files: list[dict] = field(default_factory=list)  # input files: path, bytes, digest, split
    dense_transform: str = DENSE_TRANSFORM
    columns: dict[str, str] = field(
        default_factory=lambda: {LABEL: "float32", **{c: "float32" for c in DENSE}, **{c: "int32" for c in SPARSE}}
    )
    version: int = 1

    def save(self, path: str | os.PathLike) -> None:
        """Write `schema.json` atomically."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
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
        """Cardinalities in column order C1..C26: the embedding table sizes."""
        return [int(self.cardinalities[c]) for c in SPARSE]

    def differences(self, other: "Schema") -> list[str]:
        """Human-readable differences that make two datasets incompatible for one model."""
        diffs = []
        for col in SPARSE:
            a, b = self.cardinalities.get(col), other.cardinalities.get(col)
            if a != b:
                diffs.append(f"{col} cardinality {a} != {b}")
        if self.vocab_hash != other.vocab_hash:
            diffs.append(f"vocab_hash {self.vocab_hash[:12]} != {other.vocab_hash[:12]}")
        return diffs
