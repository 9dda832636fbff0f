"""`ctrflow predict --checkpoint CKPT --data DIR --input FILE... --out FILE.csv|.parquet [--keep-columns COL,...]`:
batch scoring."""

from __future__ import annotations

import argparse
import json

from ctrflow.commands.checkpoint_flags import add_checkpoint_flags, chosen_checkpoint


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of the predict step."""
    add_checkpoint_flags(parser)
    parser.add_argument("--data", required=True, help="processed data directory holding the vocabularies")
    parser.add_argument("--input", required=True, nargs="+", metavar="FILE",
                        help="raw files in the format of the dataset description --data was preprocessed "
                             "from (csv, tsv or parquet; with or without the label column; plain or gzip; "
                             "globs); for Criteo, the 40-column training or 39-column test layout")
    parser.add_argument("--out", required=True,
                        help="output .csv or .parquet: the --keep-columns, probability (and label) per row, in "
                             "input order (csv: the csv module's minimal quoting)")
    parser.add_argument("--keep-columns", default="", metavar="COL,...",
                        help="raw columns of the inputs to pass through to the output as text, e.g. an id to join "
                             "the scores back on (default: none)")
    parser.add_argument("--batch-size", type=int, default=16384, help="rows scored at once")


def run(args: argparse.Namespace) -> int:
    """Score the inputs and print a one-line JSON summary."""
    from ctrflow.predict import predict

    keep = [name.strip() for name in args.keep_columns.split(",") if name.strip()]
    summary = predict(chosen_checkpoint(args), args.data, args.input, args.out, batch_size=args.batch_size, keep=keep)
    print(json.dumps(summary))
    return 0
