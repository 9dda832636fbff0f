"""`ctrflow preprocess`: raw Criteo TSV (plain or gzip, globs) → Parquet + schema + vocabularies."""

from __future__ import annotations

import argparse
import json

from ctrflow.tracking import add_tracking_flags, tracker_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of the preprocess step (names are a contract: see ARCHITECTURE.md)."""
    from ctrflow.data.preprocess import COMPRESSIONS, DEFAULT_CHUNK_ROWS, DEFAULT_COMPRESSION

    parser.add_argument("--train", nargs="+", required=True, metavar="FILE",
                        help="training files or glob patterns (40 columns: label, I1..I13, C1..C26)")
    parser.add_argument("--valid", nargs="+", default=[], metavar="FILE",
                        help="validation files or glob patterns")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--freq-threshold", type=int, default=6,
                        help="a value needs this many occurrences in the training split to get its own id")
    parser.add_argument("--valid-fraction", type=float, default=None,
                        help="without --valid: send this fraction of the training rows to valid (seeded, per row)")
    parser.add_argument("--engine", default="cpu", choices=["cpu"], help="preprocessing engine")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    parser.add_argument("--on-bad-rows", default="error", choices=["error", "skip"],
                        help="stop at the first malformed row, or skip it and list it in DIR/rejected.tsv")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --valid-fraction split")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                        help="about this many rows per block and Parquet part (sets memory per worker)")
    parser.add_argument("--compression", default=DEFAULT_COMPRESSION, choices=COMPRESSIONS,
                        help="Parquet compression of the parts (none: fastest; snappy/zstd: smaller files)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: on a terminal, off in CI)")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Run the step; prints a one-line JSON summary."""
    from ctrflow.data.preprocess import preprocess

    with tracker_from_args(args, "preprocess") as tracker:
        summary = preprocess(args.train, args.valid, args.out, freq_threshold=args.freq_threshold,
                             valid_fraction=args.valid_fraction, workers=args.workers,
                             on_bad_rows=args.on_bad_rows, engine=args.engine, seed=args.seed,
                             tracker=tracker, chunk_rows=args.chunk_rows, progress=args.progress,
                             compression=args.compression)
    print(json.dumps({k: summary[k] for k in ("out", "rows", "rows_read", "rows_rejected", "seconds")}))
    return 0
