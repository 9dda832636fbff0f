"""Metadata that lets other tools train on ctrflow's Parquet output.

HugeCTR's Parquet data reader wants, per split directory, `_file_list.txt` (the number of files,
then one path per line) and `_metadata.json` (rows per file; label, dense and categorical column
names with their column index). Both names start with "_", so Parquet dataset readers skip them.
NVTabular/Merlin (and Merlin Models, Transformers4Rec) read a `schema.pbtxt` for column tags and domains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from ctrflow.contract.features import LABEL, Features


def write_hugectr_metadata(split_dir: Path, final_dir: Path, features: Features) -> None:
    """Write `_file_list.txt` and `_metadata.json` for the parts in `split_dir`; paths name `final_dir`
    (where the split will live once the output is published). Multi-hot features are "cats" too (a
    fixed-size list column each)."""
    parts = sorted(split_dir.glob("part-*.parquet"))
    stats = [{"file_name": p.name, "num_rows": pq.ParquetFile(p).metadata.num_rows} for p in parts]
    dense, sparse = [f.name for f in features.dense], [f.name for f in features.sparse]
    columns = (LABEL, *dense, *sparse)
    metadata = {
        "file_stats": stats,
        "labels": [{"col_name": LABEL, "index": columns.index(LABEL)}],
        "conts": [{"col_name": c, "index": columns.index(c)} for c in dense],
        "cats": [{"col_name": c, "index": columns.index(c)} for c in sparse],
    }
    (split_dir / "_metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    lines = [str(len(parts))] + [str(final_dir.resolve() / p.name) for p in parts]
    (split_dir / "_file_list.txt").write_text("\n".join(lines) + "\n")


def write_merlin_schema(out_dir: Path, features: Features) -> None:
    """Write `out_dir/schema.pbtxt` (NVTabular/Merlin's text-format schema proto; both splits have these
    columns). It is not put beside the parts: pyarrow reads every non-"_" file of a directory as Parquet.

    Categorical columns: type INT, `int_domain` min 0, max cardinality - 1 (Merlin's embedding size is
    max + 1, so it equals our `schema.json` cardinality), tag "categorical". Multi-hot: the same, with
    `value_count` min = max = max_length (a fixed-size, 0-padded list) and tag "list". Dense: type FLOAT,
    tag "continuous". Label: type FLOAT, tags "target" and "binary_classification"."""
    entries = [_feature(LABEL, "FLOAT", ("target", "binary_classification"))]
    entries += [_feature(f.name, "FLOAT", ("continuous",)) for f in features.dense]
    for f in features.sparse:
        if f.kind == "categorical":
            entries.append(_feature(f.name, "INT", ("categorical",), f.cardinality))
        else:
            entries.append(_feature(f.name, "INT", ("categorical", "list"), f.cardinality, f.max_length))
    (out_dir / "schema.pbtxt").write_text("".join(entries))


def _feature(name: str, kind: str, tags: tuple[str, ...], cardinality: int | None = None,
             length: int | None = None) -> str:
    lines = ["feature {", f'  name: "{name}"', f"  type: {kind}"]
    if cardinality is not None:
        lines += ["  int_domain {", f'    name: "{name}"', "    min: 0", f"    max: {cardinality - 1}",
                  "    is_categorical: true", "  }"]
    if length is not None:
        lines += ["  value_count {", f"    min: {length}", f"    max: {length}", "  }"]
    lines += ["  annotation {", *(f'    tag: "{tag}"' for tag in tags), "  }", "}"]
    return "\n".join(lines) + "\n"
