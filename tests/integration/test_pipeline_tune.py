"""The pipeline's tuning stage run by KFP's local runner: a study of 4 trials, 2 at a time, in one
tune task; the train task trains the best trial's config again (same AUC); the study's MLflow runs
under the pipeline's parent run."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")
pytest.importorskip("kfp")

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SPACE = "lr: {low: 0.001, high: 0.03, log: true}\ndropout: {choices: [0.0, 0.3]}\n"


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory) -> dict:
    from ctrflow_pipelines.local import run_local, summarize_local_run

    tmp = tmp_path_factory.mktemp("pipeline_tune")
    tracking = f"sqlite:///{tmp}/mlflow.db"
    arguments = {"synth_rows": 3000, "synth_days": 2, "seed": 4, "freq_threshold": 2, "batch_size": 256,
                 "embedding_dim": 4, "tune_trials": 4, "tune_parallel": 2, "tune_space": SPACE,
                 "export_backend": "python", "model_name": "tuned", "mlflow_tracking_uri": tracking,
                 "mlflow_experiment": "pipeline-tune"}
    cwd = os.getcwd()
    os.chdir(REPO)  # the tasks are subprocesses that import the repository's packages
    try:
        run_dir = run_local(tmp / "root", arguments)
    finally:
        os.chdir(cwd)
    return {**summarize_local_run(run_dir), "run_dir": run_dir, "tracking": tracking}


def trial_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "tune" / "study" / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_tune_task_runs_the_study_and_train_trains_its_best_config(tuned_run):
    run_dir = tuned_run["run_dir"]
    rows = trial_rows(run_dir)
    assert len(rows) == 4 and all(r["state"] in ("COMPLETE", "PRUNED") for r in rows)
    complete = [r for r in rows if r["state"] == "COMPLETE"]
    best = max(complete, key=lambda r: float(r["auc"]))
    best_yaml = yaml.safe_load((run_dir / "tune" / "study" / "best.yaml").read_text())
    assert best_yaml["optim"]["lr"] == pytest.approx(float(best["param.optim.lr"]))
    # trials started from the pipeline's train settings
    assert best_yaml["data"]["batch_size"] == 256 and best_yaml["model"]["embedding_dim"] == 4
    checkpoint = run_dir / "train" / "checkpoint"
    trained = json.loads((checkpoint / "config.json").read_text())["asked"]
    assert trained["optim"]["lr"] == pytest.approx(best_yaml["optim"]["lr"])
    assert trained["model"]["dropout"] == best_yaml["model"]["dropout"]
    records = [json.loads(line) for line in (checkpoint / "metrics.jsonl").read_text().splitlines() if line]
    final_auc = [r["auc"] for r in records if r.get("auc") is not None][-1]
    assert final_auc == pytest.approx(float(best["auc"]), abs=1e-4)  # the best trial, trained again
    assert tuned_run["auc"] == pytest.approx(final_auc, abs=1e-4)  # and evaluate scores that model


def test_study_tracked_under_the_pipeline_run(tuned_run):
    import mlflow

    client = mlflow.MlflowClient(tuned_run["tracking"])
    experiment = client.get_experiment_by_name("pipeline-tune")
    parent = tuned_run["mlflow_run_id"]
    children = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    study = [r for r in children if r.data.tags.get("ctrflow.step") == "tune"]
    assert len(study) == 1 and study[0].info.status == "FINISHED"
    trials = client.search_runs([experiment.experiment_id],
                                f"tags.`mlflow.parentRunId` = '{study[0].info.run_id}'")
    assert len(trials) == 4
    assert sum(r.data.tags.get("tune.best") == "true" for r in trials) == 1
    assert {"train", "evaluate", "export"} <= {r.data.tags.get("ctrflow.step") for r in children}

