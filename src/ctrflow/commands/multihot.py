"""`ctrflow multihot --data DIR --out DIR [--sizes mlperf|LIST] [--seed N]`: MLPerf DLRMv2's multi-hot data.

Expands a preprocessed one-hot dataset (`ctrflow preprocess --out DIR`) into a multi-hot one, as MLPerf
makes its multi-hot Criteo from the one-hot logs: each categorical feature of size h > 1 becomes a sum
bag of h ids, its own id first (`ctrflow.ingest.multihot`, which states the cost). The output is a
processed dataset like any other: `ctrflow train --config mlperf-dlrmv2 --data OUT`.
"""

from __future__ import annotations

import argparse
import json


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow multihot`."""
    parser.add_argument("--data", required=True, help="a preprocessed one-hot dataset (ctrflow preprocess --out)")
    parser.add_argument("--out", required=True, help="output directory: the multi-hot dataset")
    parser.add_argument("--sizes", default="mlperf",
                        help="ids per row of each sparse feature, in order: mlperf (MLPerf DLRMv2's 26, 214 ids "
                             "a row; the default) or a comma list; 1 keeps a feature categorical")
    parser.add_argument("--seed", type=int, default=0, help="the expansion's seed: same seed, same bags (default 0)")


def run(args: argparse.Namespace) -> int:
    """Write the expansion; print one JSON line (rows, ids a row, seconds)."""
    from ctrflow.ingest.multihot import expand_dataset

    print(json.dumps(expand_dataset(args.data, args.out, args.sizes, args.seed)))
    return 0
