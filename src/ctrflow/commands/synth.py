"""`ctrflow synth`: write synthetic Criteo-format day files labelled by a hidden teacher."""

from __future__ import annotations

import argparse

from ctrflow.tracking import add_tracking_flags, tracker_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow synth`."""
    parser.add_argument("--rows", type=int, default=200_000, help="rows per day file (default 200000)")
    parser.add_argument("--days", type=int, default=2, help="number of day files (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    parser.add_argument("--out", required=True, help="output directory: day_0.tsv ... and synth.json")
    parser.add_argument("--gzip", action="store_true", help="write day_N.tsv.gz instead of day_N.tsv")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Write the day files, then print one line per day with its rows, click rate and teacher AUC."""
    from ctrflow.datasets.criteo.synth import synthesize

    with tracker_from_args(args, "synth") as tracker:
        report = synthesize(args.out, args.rows, args.days, args.seed, gzip=args.gzip, tracker=tracker)
    for entry, day in zip(report["files"], report["teacher_auc"]):
        print(f"{args.out}/{entry['path']}: {entry['rows']} rows, ctr {report['ctr'][day]:.4f}, "
              f"teacher auc {report['teacher_auc'][day]:.4f}")
    total = args.rows * args.days
    print(f"{total} rows in {report['seconds']:.1f} s ({total / report['seconds']:,.0f} rows/s)")
    return 0
