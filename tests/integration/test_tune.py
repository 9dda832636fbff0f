"""`ctrflow tune` on real preprocessed data: the study, its MLflow runs, best.yaml reproducing the
best trial, a study killed and continued, a pruned trial stopped early."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

from ctrflow.cli import main  # noqa: E402
from ctrflow.processes import process_alive  # noqa: E402
from ctrflow.tune.run import prepare  # noqa: E402
from ctrflow.tune.runner import run_trials  # noqa: E402
from ctrflow.tune.study import open_study  # noqa: E402

pytestmark = pytest.mark.integration
ENV = {**os.environ, "MLFLOW_TRACKING_URI": "none"}
BASE = "data: {batch_size: 256, prefetch: 2}\ndevice: cpu\nlog_every: 5\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Synthetic Criteo, 2 days of 5,000 rows (train, valid), preprocessed at threshold 2."""
    root = tmp_path_factory.mktemp("tune_data")
    for argv in (["synth", "--rows", "5000", "--days", "2", "--seed", "3", "--out", str(root / "raw")],
                 ["preprocess", "--train", str(root / "raw" / "day_0.tsv"), "--valid", str(root / "raw" / "day_1.tsv"),
                  "--out", str(root / "processed"), "--freq-threshold", "2", "--workers", "1"]):
        subprocess.run([sys.executable, "-m", "ctrflow", *argv, "--tracking-uri", "none"], check=True, env=ENV,
                       capture_output=True)
    (root / "base.yaml").write_text(BASE)
    return root


def tune_argv(data: Path, out: Path, space: str, *extra: str) -> list[str]:
    (out.parent / f"{out.name}_space.yaml").write_text(space)
    return ["tune", "--data", str(data / "processed"), "--model", "dlrm", "--config", str(data / "base.yaml"),
            "--space", str(out.parent / f"{out.name}_space.yaml"), "--out", str(out), *extra]


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_study_tracks_every_trial_and_best_yaml_reproduces_the_best(data, tmp_path):
    out = tmp_path / "study"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    space = ("lr: {low: 0.001, high: 0.01, log: true}\nembedding_dim: {choices: [4, 8]}\n"
             "freq_threshold: {low: 2, high: 5}\n")
    code = main(tune_argv(data, out, space, "--trials", "3", "--parallel", "2", "--pruner", "none",
                          "--keep-best", "1", "--tracking-uri", uri, "--experiment", "tune-test"))
    assert code == 0
    rows = read_csv(out / "trials.csv")
    assert [r["state"] for r in rows] == ["COMPLETE"] * 3
    assert all(len(r["auc_per_validation"].split()) == 4 for r in rows)  # 19 steps: 5, 10, 15, 19
    best = max(rows, key=lambda r: float(r["auc"]))
    assert sorted(p.name for p in (out / "plots").iterdir()) == \
        ["optimization_history.png", "parallel_coordinate.png", "param_importances.png"]
    for r in rows:  # the best trial's checkpoint stays, the others' go
        steps = list((out / "trials" / f"{int(r['number']):04d}").glob("step_*"))
        assert bool(steps) == (r is best)
    threshold = int(best["param.freq_threshold"])
    best_yaml = (out / "best.yaml").read_text()
    expected_data = out / "views" / f"threshold_{threshold}" if threshold != 2 else data / "processed"
    assert f"path: {expected_data}" in best_yaml

    # the whole config, as it is: the same seed and data on the CPU give the same AUC
    assert main(["train", "--config", str(out / "best.yaml"), "--tracking-uri", "none", "--no-progress"]) == 0
    again = json.loads((out / "best" / "train_summary.json").read_text())["valid_auc"]
    assert again == pytest.approx(float(best["auc"]), abs=1e-4)

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tune-test").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(parents) == 1 and len(children) == 3
    tagged = [c for c in children if c.data.tags.get("tune.best") == "true"]
    assert [c.data.tags["tune.trial"] for c in tagged] == [best["number"]]
    assert parents[0].data.tags["tune.best_trial"] == best["number"]
    assert parents[0].data.metrics["best_auc"] == pytest.approx(float(best["auc"]))
    child = tagged[0]
    assert set(child.data.params) == {"optim.lr", "model.embedding_dim", "freq_threshold"}
    history = client.get_metric_history(child.info.run_id, "auc")
    assert [m.step for m in history] == [5, 10, 15, 19]
    assert child.data.metrics["pruned"] == 0 and child.data.metrics["duration_s"] > 0
    artifacts = {a.path for a in client.list_artifacts(parents[0].info.run_id)}
    assert {"trials.csv", "best.yaml", "plots"} <= artifacts


def test_a_killed_study_continues_where_it_stopped(data, tmp_path):
    out = tmp_path / "study"
    argv = tune_argv(data, out, "lr: {low: 0.001, high: 0.01, log: true}\n", "--trials", "3", "--parallel", "1",
                     "--pruner", "none", "--tracking-uri", "none")
    tuner = subprocess.Popen([sys.executable, "-m", "ctrflow", *argv], env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and tuner.poll() is None:
        if (out / "trials" / "0001" / "metrics.jsonl").exists():  # trial 0 done, trial 1 training
            tuner.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    tuner.wait()
    assert tuner.returncode == -signal.SIGKILL, "the study finished before it could be killed"
    storage = f"sqlite:///{out / 'study.db'}"
    before = optuna.load_study(study_name="ctrflow-tune", storage=storage).get_trials()
    assert [t.state.name for t in before] == ["COMPLETE", "RUNNING"]
    orphan = before[1].user_attrs["train_pid"]
    time.sleep(1)
    assert not process_alive(orphan)  # the trial died with the study

    done = subprocess.run([sys.executable, "-m", "ctrflow", *argv], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "trial 1: interrupted earlier; queued again" in done.stdout
    after = optuna.load_study(study_name="ctrflow-tune", storage=storage).get_trials()
    assert [t.state.name for t in after] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert after[0].value == before[0].value  # kept, not run again
    assert after[2].user_attrs["retry_of"] == 1 and after[2].params == before[1].params
    assert [r["state"] for r in read_csv(out / "trials.csv")] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]


def test_a_pruned_trial_stops_early(data, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("lr: {low: 0.0000001, high: 0.01, log: true}\nsparse_lr: {low: 0.0000001, high: 0.1, log: true}\n")
    settings = prepare(data / "processed", space, tmp_path / "study", "dlrm", str(data / "base.yaml"))
    study = open_study(settings, pruner="median", trials=2)
    study.optuna.enqueue_trial({"optim.lr": 0.01, "optim.sparse_lr": 0.1})  # learns
    study.optuna.enqueue_trial({"optim.lr": 1e-7, "optim.sparse_lr": 1e-7})  # stays where it started
    progress = run_trials(study, trials=2, parallel=1, log=lambda line: None)
    assert progress.finished == {0: "COMPLETE", 1: "PRUNED"}
    good, bad = study.optuna.get_trials()
    pruned_at = max(bad.intermediate_values)  # the validation it stopped after: worse than the median there
    assert pruned_at < 4 and bad.intermediate_values[pruned_at] < good.intermediate_values[pruned_at]
    records = [json.loads(line) for line in (tmp_path / "study" / "trials" / "0001" / "metrics.jsonl").open()]
    assert max(r["step"] for r in records) < 19  # stopped before the epoch's 19 steps
    assert good.user_attrs["steps"][-1] == 19
    assert not list((tmp_path / "study" / "trials" / "0001").glob("step_*"))
    assert not process_alive(bad.user_attrs["train_pid"])


def test_the_budget_stops_starting_trials(data, tmp_path, capsys):
    out = tmp_path / "study"
    code = main(tune_argv(data, out, "lr: {low: 0.001, high: 0.01, log: true}\n", "--trials", "5", "--parallel", "1",
                          "--budget-minutes", "0.05", "--tracking-uri", "none"))
    assert code == 0  # the trial started within the 3 s finishes; none starts after
    assert [r["state"] for r in read_csv(out / "trials.csv")] == ["COMPLETE"]
    assert "1 complete; best trial 0" in capsys.readouterr().out
