"""`ctrflow evaluate` as a component: exact AUC and logloss, plots."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Model, Output

from ctrflow_components.image import TRAIN_IMAGE


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def evaluate(data: Input[Dataset], checkpoint: Input[Model], metrics: Output[Metrics],
             report: Output[Artifact], tracking_uri: str = "", experiment: str = "ctrflow",
             parent_run_id: str = "", kfp_run_id: str = ""):
    """Score the validation split: `report` holds metrics.json and the plots, `metrics` the
    headline numbers (auc, logloss, rows, calibration)."""
    import json
    from pathlib import Path

    from ctrflow.cli import main
    from ctrflow.tracking import tracking_argv

    argv = ["evaluate", "--data", data.path, "--checkpoint", checkpoint.path, "--out", report.path,
            *tracking_argv(tracking_uri, experiment, parent_run_id, {"kfp.run_id": kfp_run_id})]
    if main(argv) != 0:
        raise RuntimeError(f"ctrflow {' '.join(argv)} failed")
    result = json.loads((Path(report.path) / "metrics.json").read_text())
    for key in ("auc", "logloss", "normalized_entropy", "rows", "mean_prediction", "observed_ctr"):
        if result.get(key) is not None:
            metrics.log_metric(key, result[key])
    report.metadata.update(auc=result.get("auc"), logloss=result.get("logloss"), rows=result.get("rows"))
