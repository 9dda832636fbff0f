"""`ctrflow evaluate --data DIR --checkpoint CKPT --out DIR2`: metrics.json, ROC and calibration plots."""

from __future__ import annotations

import argparse
import json

from ctrflow.commands.checkpoint_flags import add_checkpoint_flags, chosen_checkpoint
from ctrflow.tracking import add_tracking_flags, tracker_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of the evaluate step."""
    parser.add_argument("--data", required=True, help="processed data directory (`ctrflow preprocess --out`)")
    add_checkpoint_flags(parser)
    parser.add_argument("--out", required=True, help="directory for metrics.json, roc.png, calibration.png")
    parser.add_argument("--split", default="valid", help="split of --data to score (default: valid)")
    parser.add_argument("--batch-size", type=int, default=16384, help="rows scored at once")
    parser.add_argument("--bins", type=int, default=10,
                        help="equal-mass (equal-count) bins of the calibration table and its ECE")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the model scores (default: a GPU when there is one)")
    parser.add_argument("--embedding-memory-gib", type=float, default=None, metavar="N",
                        help="device memory the embedding tables may take; the tables beyond it stay in host "
                             "memory, read through a device cache of the rows the batches use (default: every "
                             "table on the device)")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Evaluate and print the headline metrics as one JSON line."""
    from ctrflow.evaluate import evaluate

    with tracker_from_args(args, "evaluate") as tracker:
        metrics = evaluate(args.data, chosen_checkpoint(args), args.out, split=args.split,
                           batch_size=args.batch_size, bins=args.bins, device=args.device,
                           tracker=tracker, embedding_memory_gib=args.embedding_memory_gib)
    headline = {k: metrics[k] for k in ("auc", "logloss", "rows", "mean_prediction", "observed_ctr")}
    print(json.dumps({**headline, "out": args.out}))
    return 0
