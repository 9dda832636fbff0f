"""`ctrflow demo --out DIR [--dataset criteo|movielens-like]`: the README's one command. Synthetic
days (day_0 train, day_1 valid; raw Criteo TSV, or movielens-like CSV with a multi-hot genre list
and its dataset description) through the whole KFP pipeline on this machine, tracked in a SQLite
MLflow store under DIR; prints the model's AUC beside the hidden teacher's, and how to open the run
in the MLflow UI."""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from ctrflow.errors import UserError

HELP = "synthetic data -> whole pipeline locally -> MLflow run"
EXPERIMENT = "ctrflow-demo"


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow demo`."""
    parser.add_argument("--out", default="runs/demo", help="folder for data, outputs, MLflow store, logs")
    parser.add_argument("--dataset", default="criteo", choices=("criteo", "movielens-like"),
                        help="which synthetic dataset runs through the pipeline (default criteo)")
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic rows per day (default 200000)")
    parser.add_argument("--model", default="dlrm", choices=("dlrm", "dcnv2", "deepfm", "wide_deep"))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI (default: sqlite:///OUT/mlflow.db)")


def run(args: argparse.Namespace) -> int:
    """Run the pipeline locally and print its headline."""
    try:
        from ctrflow_pipelines.local import run_local, summarize_local_run
    except ModuleNotFoundError as err:
        raise UserError(f"cannot import {err.name!r}: run the demo from a ctrflow checkout "
                        f"(pip install -e .)") from None
    if args.rows < 100:
        raise UserError(f"--rows {args.rows}: use at least 100 rows a day")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    uri = args.tracking_uri or f"sqlite:///{out / 'mlflow.db'}"
    arguments = {"synth_rows": args.rows, "synth_days": 2, "dataset": args.dataset, "train_files": "day_0.*",
                 "valid_files": "day_1.*", "seed": args.seed, "model": args.model, "epochs": args.epochs,
                 "mlflow_tracking_uri": uri, "mlflow_experiment": EXPERIMENT}
    print(f"ctrflow demo: {args.rows:,} synthetic {args.dataset} rows a day (day_0 train, day_1 valid), "
          f"{args.model}, {args.epochs} epoch(s); task logs in {out / 'pipeline.log'}", flush=True)
    started = time.perf_counter()
    try:
        run_dir = run_local(out / "pipeline", arguments, log_file=out / "pipeline.log")
    except RuntimeError as err:
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(err).splitlines()[0])  # no terminal colours
        raise UserError(f"{message} (task logs: {out / 'pipeline.log'})") from None
    summary = {**summarize_local_run(run_dir), "tracking_uri": uri, "experiment": EXPERIMENT,
               "experiment_id": experiment_id(uri, EXPERIMENT),
               "wall_seconds": round(time.perf_counter() - started, 1), "rows_per_day": args.rows,
               "dataset": args.dataset}
    (out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_headline(summary)
    return 0


def experiment_id(uri: str, name: str) -> str | None:
    """The id of MLflow experiment `name` (for the UI link); None when tracking is off."""
    if uri.lower() == "none":
        return None
    from mlflow import MlflowClient

    found = MlflowClient(uri).get_experiment_by_name(name)
    return found.experiment_id if found else None


def print_headline(summary: dict) -> None:
    """The lines a user looks for: AUCs, the MLflow run, where the model went."""
    auc, teacher = summary.get("auc"), summary.get("teacher_auc")
    print(f"\nmodel AUC on day_1:   {auc:.4f}")
    if teacher:
        print(f"teacher AUC on day_1: {teacher:.4f}  (the model recovers {(auc - 0.5) / (teacher - 0.5):.0%} "
              f"of the teacher's AUC above chance)")
    if summary.get("repository"):
        print(f"Triton repository:    {summary['repository']}")
    if summary.get("registered_version"):
        print(f"registered model:     {summary['model_name']} version {summary['registered_version']} "
              f"(alias candidate)")
    run_id = summary.get("mlflow_run_id")
    if run_id:
        print(f"MLflow run:           {run_id} (experiment {summary['experiment']}, {summary['tracking_uri']})")
        if summary["tracking_uri"].startswith("sqlite:"):
            print(f"open it with:         mlflow ui --backend-store-uri {summary['tracking_uri']}")
            print(f"                      then http://127.0.0.1:5000/#/experiments/"
                  f"{summary.get('experiment_id', '')}/runs/{run_id}")
    print(f"wall time:            {summary['wall_seconds']:.0f} s")
