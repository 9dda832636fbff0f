"""`ctrflow promote --model NAME [--data DIR --split valid] [--min-gain X]`: the AUC gate of the model registry.

Moves the `champion` alias to the `candidate` version when the candidate's AUC is above 0.5 and
at least the champion's plus `--min-gain` (`ctrflow.promotion`); otherwise refuses, says why in one
line (both AUCs) and exits 1. With `--data` both AUCs are computed on the same rows (the newest
day's held-out split); without it the AUCs recorded with each version are compared. The decision
is logged as an MLflow run (both AUCs, the rows, whether the alias moved).
"""

from __future__ import annotations

import argparse
import json

from ctrflow.errors import UserError
from ctrflow.tracking import add_tracking_flags, resolve_tracking_uri, tracker_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow promote`."""
    parser.add_argument("--model", required=True, help="registered model name (the export's --name)")
    parser.add_argument("--data", default=None,
                        help="processed data directory: score both versions on it (else the recorded AUCs)")
    parser.add_argument("--split", default="valid", help="split of --data to score on (default: valid)")
    parser.add_argument("--min-gain", type=float, default=0.0,
                        help="AUC the candidate must gain over the champion (default 0: an equal AUC passes)")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Apply the gate; 0 when promoted, 1 when refused (the aliases unchanged)."""
    uri = resolve_tracking_uri(args.tracking_uri)
    if uri.lower() == "none":
        raise UserError("--tracking-uri none: promote needs an MLflow registry")
    from ctrflow.promotion import promote

    verdict = promote(args.model, uri, data=args.data, split=args.split, min_gain=args.min_gain)
    with tracker_from_args(args, "promote") as tracker:
        tracker.log_params({"model": args.model, "candidate_version": verdict.candidate_version,
                            "champion_version": verdict.champion_version, "data": args.data,
                            "split": verdict.split, "min_gain": args.min_gain})
        tracker.log_metrics({k: v for k, v in (("candidate_auc", verdict.candidate_auc),
                                               ("champion_auc", verdict.champion_auc),
                                               ("rows", verdict.rows)) if v is not None})
        tracker.set_tags({"promoted": str(verdict.promoted).lower(), "reason": verdict.reason[:5000],
                          "champion_version_after": verdict.candidate_version if verdict.promoted
                          else str(verdict.champion_version)})
    if args.json:
        print(json.dumps(verdict.to_json()))
    elif verdict.promoted:
        print(f"promoted {args.model} version {verdict.candidate_version} to champion: {verdict.reason}")
    else:
        print(f"not promoted: {verdict.reason}")
    return 0 if verdict.promoted else 1
