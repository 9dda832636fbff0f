"""`ctrflow promote --model NAME [--data DIR --split valid]`: the AUC gate of the model registry.

Moves the `champion` alias to the `candidate` version when the candidate's AUC is above chance (0.5)
and at least the champion's; otherwise refuses, says why (both AUCs) and exits 1. Without `--data`
the AUCs are the ones recorded with each version; with it both are recomputed on the same rows.
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
                        help="processed data directory: recompute both AUCs on it (else the recorded ones)")
    parser.add_argument("--split", default="valid", help="split of --data to evaluate on (default: valid)")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Apply the gate; 0 when promoted, 1 when refused (nothing changed)."""
    uri = resolve_tracking_uri(args.tracking_uri)
    if uri.lower() == "none":
        raise UserError("--tracking-uri none: promote needs an MLflow registry")
    from ctrflow.registry import promote

    verdict = promote(args.model, uri, data=args.data, split=args.split)
    with tracker_from_args(args, "promote") as tracker:
        tracker.log_params({"model": args.model, "candidate_version": verdict.candidate_version,
                            "champion_version": verdict.champion_version, "data": args.data})
        tracker.log_metrics({k: v for k, v in (("candidate_auc", verdict.candidate_auc),
                                               ("champion_auc", verdict.champion_auc)) if v is not None})
        tracker.set_tags({"promoted": str(verdict.promoted).lower(), "reason": verdict.reason})
    if args.json:
        print(json.dumps(verdict.__dict__))
    elif verdict.promoted:
        print(f"promoted {args.model} version {verdict.candidate_version} to champion: {verdict.reason}")
    else:
        print(f"not promoted: {verdict.reason}")
    return 0 if verdict.promoted else 1
