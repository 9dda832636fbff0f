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
    from ctrflow.models import MODELS  # the registered models

    parser.add_argument("--out", default="runs/demo", help="folder for data, outputs, MLflow store, logs")
    parser.add_argument("--dataset", default="criteo", choices=("criteo", "movielens-like"),
                        help="which synthetic dataset runs through the pipeline")
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic rows per day")
    parser.add_argument("--model", default="dlrm", choices=list(MODELS), help="ranking model")
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
    """The lines a user looks for: AUCs, where the model went, how to open the MLflow run."""
    print("\n" + "\n".join(headline(summary)), flush=True)


def headline(summary: dict) -> list[str]:
    """`print_headline`'s lines, labels aligned in one column."""
    from ctrflow.tracking.ui import experiment_link, model_link, run_link, ui_base, ui_command

    auc, teacher = summary.get("auc"), summary.get("teacher_auc")
    rows = [("model AUC on day_1", f"{auc:.4f}")]
    if teacher:
        recovered = (auc - 0.5) / (teacher - 0.5)
        rows.append(("teacher AUC on day_1",
                     f"{teacher:.4f}  (the model recovers {recovered:.0%} of the teacher's AUC above chance)"))
    if summary.get("repository"):
        rows.append(("Triton repository", summary["repository"]))
    base, run_id, experiment = ui_base(summary["tracking_uri"]), summary.get("mlflow_run_id"), summary.get("experiment_id")
    if summary.get("registered_version"):
        version = f"{summary['model_name']} version {summary['registered_version']}"
        rows.append(("registered model", f"{version} (alias candidate)"))
    if run_id and base and experiment:
        rows.append(("MLflow run", f"{run_id} (experiment {summary['experiment']}, {summary['tracking_uri']})"))
        command = ui_command(summary["tracking_uri"])
        if command:
            rows.append(("open the MLflow UI", command))
        rows += [("then the pipeline run", run_link(experiment, run_id, base)),
                 ("all runs", experiment_link(experiment, base))]
        if summary.get("registered_version"):
            rows.append(("the model", model_link(summary["model_name"], summary["registered_version"], base)))
    rows.append(("wall time", f"{summary['wall_seconds']:.0f} s"))
    width = max(len(label) for label, _ in rows) + 1
    return [f"{label + ':':<{width}} {value}" for label, value in rows]
