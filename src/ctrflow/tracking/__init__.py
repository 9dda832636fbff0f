"""Experiment tracking: the `Tracker` interface, a no-op one and MLflow (imported lazily).

Every step takes the same flags (`add_tracking_flags`) and builds its tracker with
`tracker_from_args`, so a step run by hand, by KFP or by the demo logs the same way.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

from ctrflow.errors import UserError
from ctrflow.tracking.base import NullTracker, Tracker
from ctrflow.tracking.child import ChildTracker, take

__all__ = ["NullTracker", "Tracker", "add_tracking_flags", "finish_pipeline_run", "make_tracker",
           "resolve_tracking_uri", "start_pipeline_run", "track_dataset", "tracker_from_args", "tracking_argv"]

DEFAULT_URI = "sqlite:///mlflow.db"  # a local SQLite store when nothing else is configured


def add_tracking_flags(parser: argparse.ArgumentParser) -> None:
    """The MLflow flags every step shares."""
    group = parser.add_argument_group("tracking (MLflow)")
    group.add_argument("--tracking-uri", default=None,
                       help=f"MLflow tracking URI; 'none' disables tracking "
                            f"(default: $MLFLOW_TRACKING_URI, else {DEFAULT_URI})")
    group.add_argument("--experiment", default="ctrflow", help="MLflow experiment name")
    group.add_argument("--run-name", default=None, help="name of this step's MLflow run (default: the step's name)")
    group.add_argument("--parent-run-id", default=None,
                       help="MLflow run id of the pipeline run this step belongs to (nested run)")
    group.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                       help="extra run tag, repeatable (e.g. kfp_run_id=...)")


def tracking_argv(uri: str = "", experiment: str = "ctrflow", parent_run_id: str = "",
                  tags: dict[str, str] | None = None) -> list[str]:
    """The `add_tracking_flags` flags for these settings (empty values left out): how the KFP
    components hand their MLflow settings to a step's CLI."""
    argv = ["--experiment", experiment]
    if uri:
        argv += ["--tracking-uri", uri]
    if parent_run_id:
        argv += ["--parent-run-id", parent_run_id]
    for key, value in (tags or {}).items():
        if value:
            argv += ["--tag", f"{key}={value}"]
    return argv


def resolve_tracking_uri(uri: str | None) -> str:
    """The URI to use: the given one, else $MLFLOW_TRACKING_URI, else the local SQLite file."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def check_server(uri: str, timeout: float = 5.0) -> None:
    """For an http(s) tracking URI, a UserError at once when nothing listens at its host and port:
    MLflow's client would retry every call with backoff for minutes before failing."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    if getproxies().get(parts.scheme) and not proxy_bypass(parts.hostname):
        return  # reached through a proxy: this machine may not reach the host itself
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as err:
        raise UserError(f"MLflow tracking server {uri} does not answer ({err.strerror or err}): start it, "
                        "or pass --tracking-uri none to run without tracking") from None


def make_tracker(uri: str | None, experiment: str = "ctrflow", run_name: str | None = None,
                 parent_run_id: str | None = None, tags: dict[str, str] | None = None,
                 start_ms: int | None = None) -> Tracker:
    """An MLflow tracker, or a `NullTracker` when tracking is off or mlflow is not installed.

    A step's own run is logged by the child process its command started as it began
    (`ctrflow.tracking.child`), beside the step's work, from the command's start time. Any other run
    (a pipeline's, a study's trials) is logged in this process from `start_ms` (default: now),
    every call returning when logged.
    """
    uri = resolve_tracking_uri(uri)
    if uri.lower() == "none":
        return NullTracker()
    started = take(uri)  # its server was checked when the child started
    if started is not None:
        return ChildTracker(started[0], uri, experiment, run_name, parent_run_id, tags or {}, started[1])
    try:
        from ctrflow.tracking.mlflow_tracker import MlflowTracker
    except ImportError as err:  # e.g. the GPU machine, which has no mlflow
        print(f"ctrflow: tracking disabled ({err})", file=sys.stderr)
        return NullTracker()
    check_server(uri)
    return MlflowTracker(uri, experiment, run_name, parent_run_id, tags or {}, start_ms=start_ms)


def tracker_from_args(args: argparse.Namespace, step: str) -> Tracker:
    """The tracker a step's parsed flags ask for; the run is named after the step by default."""
    tags = dict(t.split("=", 1) for t in args.tag)
    tags.setdefault("ctrflow.step", step)
    return make_tracker(args.tracking_uri, args.experiment, args.run_name or step, args.parent_run_id, tags)


def start_pipeline_run(uri: str | None, experiment: str, run_name: str, kfp_run_id: str,
                       params: dict) -> str:
    """Open the parent run of one pipeline run (left open: `finish_pipeline_run` closes it);
    returns its id, or "" when tracking is off."""
    from ctrflow.tracking.pipeline_summary import STEP_VALUES

    tracker = make_tracker(uri, experiment, run_name, tags={"kfp.run_id": kfp_run_id, "ctrflow.step": "pipeline"})
    # "the step's default" (0, ""): `finish_pipeline_run` logs the value the step used instead
    tracker.log_params({k: v for k, v in params.items() if not (k in STEP_VALUES and str(v) in ("0", "0.0", ""))})
    return tracker.run_id or ""


def track_dataset(raw: Path, data: Path, uri: str | None, experiment: str, parent_run_id: str,
                  tags: dict[str, str]) -> list[dict]:
    """Log child runs describing a pipeline's data from the files the data steps wrote: `synth`
    (when `raw/synth.json` exists: its parameters, teacher AUC and CTR per day) and `preprocess`
    (rows, cardinalities, pass times, schema.json and stats.json, tag vocab_hash), as the steps
    themselves log when run by hand, each with the time it ran (`data_times`). Returns
    [{"step", "run_id"}] (run_id None when tracking is off)."""
    import json

    from ctrflow.ingest.accounting import summarize, track
    from ctrflow.contract.schema import Schema

    tags = {k: v for k, v in tags.items() if v}
    times, logged = data_times(raw, data), []
    if (raw / "synth.json").exists():
        report = json.loads((raw / "synth.json").read_text())
        with make_tracker(uri, experiment, "synth", parent_run_id or None, {**tags, "ctrflow.step": "synth"},
                          times["synth"][0]) as tracker:
            tracker.log_params({k: report[k] for k in ("rows", "days", "seed", "gzip")})
            metrics = {f"teacher_auc_{k}": v for k, v in report["teacher_auc"].items()}
            tracker.log_metrics({**metrics, **{f"ctr_{k}": v for k, v in report["ctr"].items()}})
            tracker.log_artifact(raw / "synth.json")
            tracker.close(end_ms=times["synth"][1])
        logged.append({"step": "synth", "run_id": tracker.run_id})
    schema, stats = Schema.load(data), json.loads((data / "stats.json").read_text())
    inputs = {split: [Path(f["path"]).name for f in schema.files if f["split"].startswith(split)]
              for split in ("train", "valid")}
    with make_tracker(uri, experiment, "preprocess", parent_run_id or None,
                      {**tags, "ctrflow.step": "preprocess"}, times["preprocess"][0]) as tracker:
        track(tracker, summarize(data, schema, stats, workers=None), stats, data,
              {**inputs, "freq_threshold": schema.freq_threshold, "fanout_files": len(schema.files)})
        tracker.close(end_ms=times["preprocess"][1])
    logged.append({"step": "preprocess", "run_id": tracker.run_id})
    return logged


def data_times(raw: Path, data: Path) -> dict[str, tuple[int, int]]:
    """(start, end) in ms of the data steps that wrote `raw` and `data`, from their files: synth ran
    from its first file to `synth.json`, preprocess for its `stats.json`'s total seconds up to it."""
    import json

    def written_ms(path: Path) -> int:
        return int(path.stat().st_mtime * 1000)

    stats = data / "stats.json"
    end = written_ms(stats)
    times = {"preprocess": (end - int(json.loads(stats.read_text())["passes"]["total_seconds"] * 1000), end)}
    if (raw / "synth.json").exists():
        times["synth"] = (min(written_ms(p) for p in raw.iterdir()), written_ms(raw / "synth.json"))
    return times


def finish_pipeline_run(uri: str | None, experiment: str, kfp_run_id: str, status: str) -> str | None:
    """Close the parent run of pipeline run `kfp_run_id` (FINISHED or FAILED), summarizing its
    steps' metrics on it; returns its id, None when tracking is off or no such run exists."""
    uri = resolve_tracking_uri(uri)
    if uri.lower() == "none":
        return None
    from ctrflow.tracking.mlflow_tracker import finish_pipeline_run as finish

    return finish(uri, experiment, kfp_run_id, status)
