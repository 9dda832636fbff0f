"""What the parent run of a pipeline run shows, so that a user who opens it finds everything: the
headline metrics, the parameters the steps used, the evaluation plots and the registered model.

MLflow keeps each step's metrics, plots and model version on that step's (child) run; the parent
page lists none of them by itself. `summarize_pipeline_run` copies the headline and the plots onto
the parent and writes its description (`mlflow.note.content`, markdown); MLflow's run page lists the
step runs ("Child runs") itself, and the model version ("Registered models") through the logged model
the export step linked to the parent (`MlflowTracker.register_model`).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

STEP_TAG = "ctrflow.step"
NOTE_TAG = "mlflow.note.content"  # the run page's Description, rendered as markdown
MODEL_TAG = "ctrflow.registered_model"  # "<name>/<version>", set by the step that registered it
HEADLINE = ("auc", "logloss")  # evaluate's metrics repeated on the parent under their own names
PLOTS = "evaluate"  # the artifact folder of evaluate's metrics.json and plots, on both runs
SUMMARY_FIRST = ("evaluate", "train", "export")
BATCH = 1000  # MLflow takes at most 1000 metrics per log_batch call
# pipeline parameters whose 0 or "" means "the step's default": (step, param) where the value used is
STEP_VALUES = {"learning_rate": ("train", "optim.lr"), "batch_size": ("train", "data.batch_size"),
               "embedding_dim": ("train", "model.embedding_dim"), "max_steps": ("train", "max_steps"),
               "freq_threshold": ("preprocess", "freq_threshold"), "raw_data": ("preprocess", "train")}


def step_name(run) -> str:
    """The pipeline step a child run logged (its `ctrflow.step` tag, else its name)."""
    return run.data.tags.get(STEP_TAG, run.info.run_name or "")


def summary_order(run) -> tuple[int, str]:
    """Headline steps first on the parent run (the UI lists metrics in logging order)."""
    step = step_name(run)
    return (SUMMARY_FIRST.index(step) if step in SUMMARY_FIRST else len(SUMMARY_FIRST), step)


def summary_metrics(children: list) -> dict[str, float]:
    """The parent's metrics: evaluate's headline (`auc`, `logloss`), then every step's latest
    metrics as `<step>.<metric>`."""
    children = sorted(children, key=summary_order)
    evaluated = next((c for c in children if step_name(c) == "evaluate"), None)
    summary = {k: evaluated.data.metrics[k] for k in HEADLINE if evaluated and k in evaluated.data.metrics}
    for child in children:
        summary.update({f"{step_name(child)}.{k}": v for k, v in child.data.metrics.items()})
    return {k: v for k, v in summary.items() if math.isfinite(v)}


def describe(children: list) -> tuple[str, dict[str, str]]:
    """(markdown description, tags) of the parent. The run page shows only the description's first
    lines until "Show more" is clicked: the AUC and the model come first, on as few lines as can be.
    It holds no links: MLflow's UI opens every link of a description in a new tab, while its own
    "Child runs" (the steps' runs) and "Registered models" boxes of the same page stay in it."""
    children = sorted(children, key=summary_order)
    evaluated = next((c for c in children if step_name(c) == "evaluate"), None)
    headline, tags = ["**ctrflow pipeline run**:"], {}
    if evaluated is not None and "auc" in evaluated.data.metrics:
        headline.append(f"validation AUC {evaluated.data.metrics['auc']:.4f} (step evaluate),")
    registered = next((c.data.tags[MODEL_TAG] for c in children if MODEL_TAG in c.data.tags), None)
    if registered:
        name, version = registered.rsplit("/", 1)
        headline.append(f"registered model **{name} version {version}** (alias candidate).")
        tags[MODEL_TAG] = registered
    lines = [" ".join(headline).rstrip(","), ""]
    if evaluated is not None:
        lines += [f"ROC and calibration plots: this run's Artifacts, folder `{PLOTS}/`.", ""]
    steps = ", ".join(step_name(c) for c in children)
    lines.append(f"The steps' own runs (parameters, metrics, artifacts): Child runs, {steps}.")
    return "\n".join(lines) + "\n", tags


def used_params(logged: dict[str, str], children: list) -> dict[str, str]:
    """The values the steps used for the pipeline parameters left to their default (not `logged`)."""
    steps = {step_name(c): c.data.params for c in children}
    return {name: steps[step][key] for name, (step, key) in STEP_VALUES.items()
            if name not in logged and key in steps.get(step, {})}


def copy_plots(client: MlflowClient, parent_id: str, children: list) -> None:
    """Copy the evaluate run's `evaluate/` artifacts (metrics.json, roc.png, calibration.png) onto the parent."""
    evaluated = [c for c in children if step_name(c) == "evaluate"]
    if not evaluated:
        return
    from ctrflow.registry import quiet_artifact_transfers

    with tempfile.TemporaryDirectory(prefix="ctrflow-plots-") as tmp, quiet_artifact_transfers():
        try:
            local = client.download_artifacts(evaluated[0].info.run_id, PLOTS, tmp)
        except Exception:  # noqa: BLE001 - an evaluate run without plots (failed early): nothing to copy
            return
        if any(Path(local).iterdir()):
            client.log_artifacts(parent_id, local, PLOTS)


def summarize_pipeline_run(client: MlflowClient, parent_id: str, children: list) -> None:
    """Headline metrics, the parameters the steps used, plots, description and links on the parent
    run `parent_id`."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0) for k, v in summary_metrics(children).items()]
    note, tags = describe(children)
    for i in range(0, len(metrics), BATCH):
        client.log_batch(parent_id, metrics=metrics[i:i + BATCH], synchronous=True)
    params = used_params(client.get_run(parent_id).data.params, children)
    client.log_batch(parent_id, params=[Param(k, v) for k, v in params.items()], synchronous=True)
    client.log_batch(parent_id, tags=[RunTag(NOTE_TAG, note), *(RunTag(k, v) for k, v in tags.items())],
                     synchronous=True)
    copy_plots(client, parent_id, children)
