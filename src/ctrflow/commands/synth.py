"""`ctrflow synth`: write synthetic day files labelled by a hidden teacher.

`--dataset criteo` (the default): raw Criteo TSV (`day_N.tsv`). `--dataset movielens-like`: CSV of
users, movies, a multi-hot genre list, an age and a price (`day_N.csv`), with its dataset
description `movielens.yaml` beside it for `ctrflow preprocess --dataset`. `--dataset dlrmv2`: the
Criteo rows with MLPerf DLRMv2's multi-hot fields (214 ids a row), described by `dlrmv2.yaml`.
`--drift F` makes days that drift (`ctrflow.synth.drift`): new values every day and a moving teacher.
`--click-rate R` sets the share of positive labels (rare clicks: e.g. 0.04).
"""

from __future__ import annotations

import argparse

from ctrflow.errors import UserError
from ctrflow.tracking import add_tracking_flags, tracker_from_args

DATASETS = ("criteo", "movielens-like", "dlrmv2")


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow synth`."""
    parser.add_argument("--dataset", default="criteo", metavar="{" + ",".join(DATASETS) + "}",
                        help="which synthetic dataset (default criteo: raw Criteo TSV; movielens-like: CSV "
                             "with a genre list, and its dataset description movielens.yaml; dlrmv2: Criteo TSV "
                             "with MLPerf DLRMv2's multi-hot fields, and its description dlrmv2.yaml)")
    parser.add_argument("--rows", type=int, default=200_000, help="rows per day file (default 200000)")
    parser.add_argument("--days", type=int, default=2, help="number of day files (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    parser.add_argument("--out", required=True, help="output directory: day_0.tsv (or .csv) ... and synth.json")
    parser.add_argument("--gzip", action="store_true", help="write day_N.tsv.gz (.csv.gz) instead")
    parser.add_argument("--drift", type=float, default=0.0, metavar="F",
                        help="from day 1 on, a share F of the category values is new each day (new users and "
                             "items appear, the ones they replace stop) and the teacher's tastes move by F a day; "
                             "recorded in synth.json (default 0: no drift, the same bytes as without it)")
    parser.add_argument("--click-rate", type=float, default=None, metavar="R",
                        help="the share of rows labelled 1: the hidden teacher's bias is shifted so its mean click "
                             "probability is R, its AUC kept near 0.80 (default: 0.23 for criteo, 0.35 for "
                             "movielens-like)")
    add_tracking_flags(parser)


def synthesizer(dataset: str):
    """The `synthesize(out, rows, days, seed, gzip, tracker, drift, click_rate)` of `dataset`; UserError
    naming the choices."""
    if dataset == "criteo":
        from ctrflow.synth.criteo import synthesize
    elif dataset == "movielens-like":
        from ctrflow.synth.movielens import synthesize
    elif dataset == "dlrmv2":
        from ctrflow.synth.dlrmv2 import synthesize
    else:
        raise UserError(f"--dataset {dataset!r}: expected one of {', '.join(DATASETS)}")
    return synthesize


def run(args: argparse.Namespace) -> int:
    """Write the day files, then print one line per day with its rows, click rate and teacher AUC."""
    synthesize = synthesizer(args.dataset)
    if args.click_rate is not None and not 0.0 < args.click_rate < 1.0:
        raise UserError(f"--click-rate must be between 0 and 1 (a share of rows), got {args.click_rate}")
    with tracker_from_args(args, "synth") as tracker:
        report = synthesize(args.out, args.rows, args.days, args.seed, gzip=args.gzip, tracker=tracker,
                            drift=args.drift, click_rate=args.click_rate)
    for entry, day in zip(report["files"], report["teacher_auc"]):
        print(f"{args.out}/{entry['path']}: {entry['rows']} rows, ctr {report['ctr'][day]:.4f}, "
              f"teacher auc {report['teacher_auc'][day]:.4f}")
    if report.get("description"):
        print(f"{args.out}/{report['description']}: the dataset description (ctrflow preprocess --dataset)")
    total = args.rows * args.days
    print(f"{total} rows in {report['seconds']:.1f} s ({total / report['seconds']:,.0f} rows/s)")
    return 0
