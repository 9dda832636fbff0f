"""Experiment tracking: the `Tracker` interface, a no-op one and MLflow (imported lazily).

Every step takes the same flags (`add_tracking_flags`) and builds its tracker with
`tracker_from_args`, so a step run by hand, by KFP or by the demo logs the same way.
"""

from __future__ import annotations

import argparse
import os
import sys

from ctrflow.tracking.base import NullTracker, Tracker

__all__ = ["NullTracker", "Tracker", "add_tracking_flags", "make_tracker", "tracker_from_args"]

DEFAULT_URI = "sqlite:///mlflow.db"  # a local SQLite store when nothing else is configured


def add_tracking_flags(parser: argparse.ArgumentParser) -> None:
    """The MLflow flags every step shares."""
    group = parser.add_argument_group("tracking (MLflow)")
    group.add_argument("--tracking-uri", default=None,
                       help=f"MLflow tracking URI; 'none' disables tracking "
                            f"(default: $MLFLOW_TRACKING_URI, else {DEFAULT_URI})")
    group.add_argument("--experiment", default="ctrflow", help="MLflow experiment name")
    group.add_argument("--run-name", default=None, help="name of this step's MLflow run")
    group.add_argument("--parent-run-id", default=None,
                       help="MLflow run id of the pipeline run this step belongs to (nested run)")
    group.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                       help="extra run tag, repeatable (e.g. kfp_run_id=...)")


def make_tracker(uri: str | None, experiment: str = "ctrflow", run_name: str | None = None,
                 parent_run_id: str | None = None, tags: dict[str, str] | None = None) -> Tracker:
    """An MLflow tracker, or a `NullTracker` when tracking is off or mlflow is not installed."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    if uri.lower() == "none":
        return NullTracker()
    try:
        from ctrflow.tracking.mlflow_tracker import MlflowTracker
    except ImportError as err:  # e.g. the GPU machine, which has no mlflow
        print(f"ctrflow: tracking disabled ({err})", file=sys.stderr)
        return NullTracker()
    return MlflowTracker(uri, experiment, run_name=run_name, parent_run_id=parent_run_id, tags=tags or {})


def tracker_from_args(args: argparse.Namespace, step: str) -> Tracker:
    """The tracker a step's parsed flags ask for; the run is named after the step by default."""
    tags = dict(t.split("=", 1) for t in args.tag)
    tags.setdefault("ctrflow.step", step)
    return make_tracker(args.tracking_uri, args.experiment, args.run_name or step, args.parent_run_id, tags)
