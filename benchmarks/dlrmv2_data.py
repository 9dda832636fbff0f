"""A processed dataset of the MLPerf DLRMv2 shape at full table sizes, for timing `ctrflow train` against
`dlrmv2.py` (the same Zipf-skewed ids, written as `ctrflow preprocess` would write them).

    PYTHONPATH=src python3 benchmarks/dlrmv2_data.py --out DIR [--train-steps 60] [--small]

Writes DIR/schema.json (the 26 tables' sizes as cardinalities, 15 multi-hot sum features, 13 dense)
and DIR/{train,valid}/part-*.parquet; no vocabularies (the ids are drawn, not counted). Then
`ctrflow train --config mlperf-dlrmv2 --data DIR` trains the benchmark's shape through the real loader.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ctrflow.contract.schema import Schema
from ctrflow.ingest.output import part_schema, write_part

sys.path.insert(0, str(Path(__file__).parent))
from dlrmv2 import BATCH, HOTNESS, ROWS, dlrmv2_features, make_batches  # noqa: E402


def write_split(folder: Path, rows: list[int], batches: int, batch: int, seed: int) -> int:
    """`batches` batches of the benchmark's ids, one Parquet part each; returns the rows written."""
    folder.mkdir(parents=True)
    features = dlrmv2_features(rows, HOTNESS)
    schema, spans = part_schema(features), features.slot_spans()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for k in range(batches):
        (dense, ids, labels), = make_batches(rows, HOTNESS, batch, 1, device, seed=seed * 100_003 + k)
        ids, dense = ids.to(torch.int32).cpu().numpy(), dense.cpu().numpy()  # dense as preprocess leaves it: log1p
        columns = {"label": labels.cpu().numpy(), **{f.name: dense[:, j] for j, f in enumerate(features.dense)}}
        for f, (start, stop) in zip(features.sparse, spans):
            columns[f.name] = ids[:, start] if f.kind == "categorical" else ids[:, start:stop]
        write_part(columns, str(folder / f"part-{k:05d}.parquet"), "none", schema)
    return batches * batch


def main(argv=None) -> None:
    """Write the dataset (module doc)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train-steps", type=int, default=60, help="train batches of the global batch")
    p.add_argument("--valid-steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--small", action="store_true", help="tables of at most 1000 rows")
    args = p.parse_args(argv)
    rows = [min(n, 1000) for n in ROWS] if args.small else list(ROWS)
    out = Path(args.out)
    counts = {split: write_split(out / split, rows, steps, args.batch_size, seed)
              for split, steps, seed in (("train", args.train_steps, 1), ("valid", args.valid_steps, 2))}
    features = dlrmv2_features(rows, HOTNESS)
    Schema(cardinalities=features.cardinalities(), freq_threshold=0, rows=counts, vocab_hash="drawn ids",
           features=features, dataset={"name": "dlrmv2-drawn"}).save(out / "schema.json")
    print(f"{out}: {counts}")


if __name__ == "__main__":
    main()
