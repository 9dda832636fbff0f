"""`ctrflow predict --checkpoint CKPT --data DIR --input FILE... --out FILE.csv|.parquet`: batch scoring."""

from __future__ import annotations

import argparse
import json


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of the predict step."""
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (`ctrflow train --out`)")
    parser.add_argument("--data", required=True, help="processed data directory holding the vocabularies")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE",
                        help="raw files in the format of the dataset description --data was preprocessed "
                             "from (csv, tsv or parquet; with or without the label column; plain or gzip; "
                             "globs); for Criteo, the 40-column training or 39-column test layout")
    parser.add_argument("--out", required=True, help="output .csv or .parquet: probability (and label) per row")
    parser.add_argument("--batch-size", type=int, default=16384, help="rows scored at once")


def run(args: argparse.Namespace) -> int:
    """Score the inputs and print a one-line JSON summary."""
    from ctrflow.predict import predict

    summary = predict(args.checkpoint, args.data, args.input, args.out, batch_size=args.batch_size)
    print(json.dumps(summary))
    return 0
