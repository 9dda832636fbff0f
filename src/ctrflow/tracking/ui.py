"""Where a user opens what ctrflow tracked: the MLflow UI command and links that land on the
model-training views.

MLflow 3's UI opens in its GenAI view unless the link carries `workflowType=machine_learning`
inside the hash route (or the browser saved that choice earlier): a fresh browser shown a plain run
link sees "Traces" and no runs. Every link ctrflow prints or records carries it. Its run list shows
no metric column until the user picks one; the experiment link opens a shared view (an experiment
tag MLflow's "Views" menu also lists) whose columns are the runs' `auc` and `logloss`.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

ML_VIEW = "workflowType=machine_learning"
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
RUNS_VIEW = "ctrflow-runs"  # the shared view's key
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # + key: an experiment tag holding a view's JSON state


def runs_view_state() -> str:
    """The shared view's state, as MLflow's UI reads it: newest runs first, AUC and logloss as columns."""
    return json.dumps({"selectedColumns": ["metrics.`auc`", "metrics.`logloss`"],
                       "orderByKey": "attributes.start_time", "orderByAsc": False})


def experiment_link(experiment_id: str, base: str = "") -> str:
    """The experiment's run list with their AUC (relative to the UI, `#/...`, without `base`)."""
    return _link(f"#/experiments/{experiment_id}/runs", base, f"viewStateShareKey={RUNS_VIEW}&")


def run_link(experiment_id: str, run_id: str, base: str = "") -> str:
    """A run's overview page."""
    return _link(f"#/experiments/{experiment_id}/runs/{run_id}", base)


def model_link(name: str, version: str | None = None, base: str = "") -> str:
    """A registered model, or one of its versions."""
    return _link(f"#/models/{name}" + (f"/versions/{version}" if version else ""), base)


def _link(route: str, base: str, query: str = "") -> str:
    return f"{base}/{route}?{query}{ML_VIEW}" if base else f"{route}?{query}{ML_VIEW}"


def ui_base(tracking_uri: str) -> str | None:
    """The UI's address for a tracking URI: the server itself, or `mlflow ui`'s default for a local
    store; None when tracking is off."""
    if tracking_uri.lower() == "none":
        return None
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return LOCAL_UI


def ui_command(tracking_uri: str) -> str | None:
    """A shell command that serves the MLflow UI of a local store (None for a server: it has one),
    runnable as printed: the `mlflow` of this environment by its path, telemetry off."""
    if tracking_uri.startswith(("http://", "https://")) or tracking_uri.lower() == "none":
        return None
    # one worker: a viewer for one person (the default 4 take minutes to start on 2 busy cores)
    return (f"MLFLOW_DISABLE_TELEMETRY=true {mlflow_executable()} ui --workers 1 "
            f"--backend-store-uri {shlex.quote(tracking_uri)}")


def mlflow_executable() -> str:
    """Shell words that run this environment's `mlflow`: its script by path (relative to the working
    directory when inside it, e.g. `.venv/bin/mlflow`: no activated venv needed), else `python -m mlflow`."""
    script = Path(sys.executable).parent / "mlflow"  # the venv's bin/, not the interpreter it links to
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m mlflow"
    local = Path(".venv", "bin", "mlflow")  # `make setup`'s venv in the working directory
    if local.exists() and os.path.samefile(local, script):
        return str(local)
    relative = os.path.relpath(script)
    return shlex.quote(str(script) if relative.startswith("..") else relative)
