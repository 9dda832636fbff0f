"""The registry against a real `mlflow server` on 127.0.0.1: the raw-rows pyfunc that each export
registers, and `ctrflow promote`'s AUC gate on the `champion` alias."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.contract.schema import Schema
from ctrflow.serve import raw_inputs

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.integration
MODEL = "ctr-registry-test"


@pytest.fixture(scope="module")
def mlflow_uri(mlflow_server) -> str:
    """The session's real `mlflow server` on 127.0.0.1 (tests/integration/conftest.py)."""
    return mlflow_server


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Synthetic data, preprocessed, and two checkpoints of it (2 steps, and 23: one epoch). DeepFM:
    it beats chance on 3,000 rows within the epoch (AUC about 0.65), so the gate can promote it."""
    tmp = tmp_path_factory.mktemp("registry")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        steps = [
            ["synth", "--rows", "3000", "--days", "2", "--seed", "5", "--out", str(tmp / "raw")],
            ["preprocess", "--train", str(tmp / "raw" / "day_0.tsv"), "--valid", str(tmp / "raw" / "day_1.tsv"),
             "--out", str(tmp / "data"), "--freq-threshold", "2"],
            *[["train", "--data", str(tmp / "data"), "--model", "deepfm", "--out", str(tmp / f"ckpt{n}"),
               "--max-steps", str(n), "--batch-size", "128", "--embedding-dim", "8"] for n in (2, 40)],
        ]
        for argv in steps:
            assert main(argv) == 0, f"ctrflow {argv[0]} failed"
    return tmp


def register(uri: str, name: str, checkpoint: Path, data: Path, auc: float | None = None) -> str:
    """What an export does: a run with the raw-rows pyfunc, registered as the new candidate."""
    from ctrflow.registry import register_pyfunc
    from ctrflow.tracking.mlflow_tracker import MlflowTracker

    with MlflowTracker(uri, "registry-test", run_name="export") as tracker:
        if auc is not None:
            tracker.log_metrics({"auc": auc})
        return register_pyfunc(tracker, name, checkpoint, data)


def champion(uri: str, name: str = MODEL) -> str:
    """The version the `champion` alias points at."""
    return mlflow.MlflowClient(uri).get_model_version_by_alias(name, "champion").version


def test_promote_moves_champion_only_when_the_candidate_auc_is_not_lower(mlflow_uri, trained, capsys):
    ckpt, data = trained / "ckpt40", trained / "data"
    flags = ["promote", "--model", MODEL, "--tracking-uri", mlflow_uri]

    first = register(mlflow_uri, MODEL, ckpt, data, auc=0.70)
    assert main(flags) == 0  # no champion yet
    assert champion(mlflow_uri) == first

    register(mlflow_uri, MODEL, ckpt, data, auc=0.65)
    capsys.readouterr()
    assert main(flags) == 1
    refusal = capsys.readouterr().out
    assert "not promoted" in refusal and "0.650000" in refusal and "0.700000" in refusal
    assert champion(mlflow_uri) == first

    tie = register(mlflow_uri, MODEL, ckpt, data, auc=0.70)
    assert main(flags) == 0  # an equal AUC passes the gate
    assert champion(mlflow_uri) == tie


def test_promote_never_makes_a_model_at_or_below_chance_the_champion(mlflow_uri, trained, capsys):
    ckpt, data, name = trained / "ckpt40", trained / "data", MODEL + "-chance"
    flags = ["promote", "--model", name, "--tracking-uri", mlflow_uri]
    client = mlflow.MlflowClient(mlflow_uri)

    for auc in (0.4108, 0.5):  # no champion yet: chance is the bar
        version = register(mlflow_uri, name, ckpt, data, auc=auc)
        capsys.readouterr()
        assert main(flags) == 1
        assert capsys.readouterr().out == (f"not promoted: candidate version {version} AUC {auc:.6f} is at or "
                                           f"below chance (0.5) (recorded AUCs)\n")
        assert client.get_registered_model(name).aliases.get("champion") is None

    old = register(mlflow_uri, name, ckpt, data, auc=0.45)
    client.set_registered_model_alias(name, "champion", old)  # e.g. set by hand before the gate existed
    version = register(mlflow_uri, name, ckpt, data, auc=0.48)  # better than the champion, still below chance
    capsys.readouterr()
    assert main(flags) == 1
    assert capsys.readouterr().out == (f"not promoted: candidate version {version} AUC 0.480000 is at or below "
                                       f"chance (0.5) (recorded AUCs)\n")
    assert champion(mlflow_uri, name) == old

    version = register(mlflow_uri, name, ckpt, data, auc=0.61)
    capsys.readouterr()
    assert main(flags) == 0
    assert capsys.readouterr().out == (f"promoted {name} version {version} to champion: candidate version {version} "
                                       f"AUC 0.610000 >= champion version {old} AUC 0.450000 + min gain 0 "
                                       f"(gain +0.160000) (recorded AUCs)\n")


def test_promote_reads_the_auc_of_the_evaluate_step_of_the_same_pipeline_run(mlflow_uri, trained):
    from ctrflow.promotion import promote
    from ctrflow.registry import register_pyfunc
    from ctrflow.tracking.mlflow_tracker import MlflowTracker

    name = MODEL + "-pipeline"
    with MlflowTracker(mlflow_uri, "registry-test", run_name="pipeline") as pipeline:
        steps = {"parent_run_id": pipeline.run_id}
        with MlflowTracker(mlflow_uri, "registry-test", "evaluate", tags={"ctrflow.step": "evaluate"}, **steps) as ev:
            ev.log_metrics({"auc": 0.7345})
        with MlflowTracker(mlflow_uri, "registry-test", "export", tags={"ctrflow.step": "export"}, **steps) as ex:
            register_pyfunc(ex, name, trained / "ckpt40", trained / "data")

    verdict = promote(name, mlflow_uri)

    assert verdict.promoted and verdict.candidate_auc == pytest.approx(0.7345)
    assert champion(mlflow_uri, name) == verdict.candidate_version


def test_promote_recomputes_both_aucs_on_the_evaluation_data(mlflow_uri, trained, capsys):
    from ctrflow.evaluate import evaluate
    from ctrflow.promotion import promote

    data = trained / "data"
    aucs = {n: evaluate(data, trained / f"ckpt{n}", trained / f"eval{n}")["auc"] for n in (2, 40)}
    name = MODEL + "-recompute"
    first = register(mlflow_uri, name, trained / "ckpt2", data)
    mlflow.MlflowClient(mlflow_uri).set_registered_model_alias(name, "champion", first)  # whatever its AUC
    register(mlflow_uri, name, trained / "ckpt40", data)

    verdict = promote(name, mlflow_uri, data=data, split="valid")

    assert verdict.candidate_auc == pytest.approx(aucs[40], abs=1e-9)
    assert verdict.champion_auc == pytest.approx(aucs[2], abs=1e-9)
    assert verdict.promoted == (aucs[40] > 0.5 and aucs[40] >= aucs[2])
    assert champion(mlflow_uri, name) == (verdict.candidate_version if verdict.promoted else verdict.champion_version)


def test_export_registers_a_pyfunc_that_scores_raw_rows_like_ctrflow_predict(mlflow_uri, trained, tmp_path,
                                                                               monkeypatch):
    data, ckpt, name = trained / "data", trained / "ckpt40", "ctr_pyfunc"
    assert main(["export", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(tmp_path / "repo"),
                 "--name", name, "--backend", "python", "--tracking-uri", mlflow_uri]) == 0
    lines = (trained / "raw" / "day_1.tsv").read_text().splitlines()[:200]
    (tmp_path / "rows.tsv").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    assert main(["predict", "--checkpoint", str(ckpt), "--data", str(data), "--input", str(tmp_path / "rows.tsv"),
                 "--out", str(tmp_path / "scores.csv")]) == 0
    offline = pd.read_csv(tmp_path / "scores.csv")["probability"].to_numpy()
    frame = pd.DataFrame([line.split("\t")[1:] for line in lines], columns=list(raw_inputs(Schema.load(data))))

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@candidate")
    served = model.predict(frame)["probability"].to_numpy()

    assert np.max(np.abs(served - offline)) <= 1e-6
    local = mlflow.artifacts.download_artifacts(f"models:/{name}@candidate", dst_path=str(tmp_path / "dl"),
                                                tracking_uri=mlflow_uri)
    assert (Path(local) / "artifacts" / "triton" / name / "config.pbtxt").exists()


def test_export_given_metrics_tags_the_auc_so_promote_needs_no_data(mlflow_uri, trained, tmp_path, capfd):
    from ctrflow.evaluate import evaluate

    data, ckpt, name = trained / "data", trained / "ckpt40", MODEL + "-metrics"
    expected = evaluate(data, ckpt, tmp_path / "eval")["auc"]
    capfd.readouterr()
    assert main(["export", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(tmp_path / "repo"),
                 "--name", name, "--backend", "pytorch", "--validation-rows", "500",
                 "--metrics", str(tmp_path / "eval" / "metrics.json"), "--tracking-uri", mlflow_uri]) == 0
    assert "Downloading artifacts" not in capfd.readouterr().err  # progress bars stay out of the step's log

    candidate = mlflow.MlflowClient(mlflow_uri).get_model_version_by_alias(name, "candidate")
    assert float(candidate.tags["auc"]) == expected and candidate.tags["backend"] == "pytorch"
    assert main(["promote", "--model", name, "--tracking-uri", mlflow_uri]) == 0
    assert champion(mlflow_uri, name) == candidate.version


def test_export_with_tracking_prints_nothing_but_its_summary(mlflow_uri, trained, tmp_path):
    """No MLflow warnings (CloudPickle, input example with raw colour codes), no INFO lines, no
    progress bars: the registered pyfunc is models-from-code with an input example."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}  # ctrflow's own defaults
    done = subprocess.run([sys.executable, "-m", "ctrflow", "export", "--checkpoint", str(trained / "ckpt40"),
                           "--data", str(trained / "data"), "--out", str(tmp_path / "repo"), "--name", "ctr_quiet",
                           "--tracking-uri", mlflow_uri], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert json.loads(done.stdout)["registered_version"] == "1"
    client = mlflow.MlflowClient(mlflow_uri, registry_uri=mlflow_uri)
    source = client.get_model_version_download_uri("ctr_quiet", "1")
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, tracking_uri=mlflow_uri,
                                                     dst_path=str(tmp_path / "dl")))
    assert not list(local.rglob("*.pkl"))  # the model is its code, nothing unpickled on load
    assert (local / "input_example.json").exists()
def promote_runs(uri: str, name: str) -> list:
    """The MLflow runs `ctrflow promote --model name` logged, newest first."""
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("registry-gate")
    return client.search_runs([experiment.experiment_id], f"params.model = '{name}'",
                              order_by=["attributes.start_time DESC"])


def test_the_gate_refuses_a_worse_candidate_on_the_same_rows_and_records_it(mlflow_uri, trained, capsys):
    from ctrflow.evaluate import evaluate

    data, name = trained / "data", MODEL + "-gate"
    scored = {n: evaluate(data, trained / f"ckpt{n}", trained / f"gate{n}") for n in (2, 40)}
    aucs, rows = {n: s["auc"] for n, s in scored.items()}, scored[40]["rows"]
    assert aucs[40] > aucs[2] > 0.5  # 40 steps rank better than 2
    flags = ["promote", "--model", name, "--data", str(data), "--tracking-uri", mlflow_uri,
             "--experiment", "registry-gate"]
    best = register(mlflow_uri, name, trained / "ckpt40", data)
    assert main(flags) == 0
    worse = register(mlflow_uri, name, trained / "ckpt2", data)
    capsys.readouterr()

    assert main(flags) == 1

    line = capsys.readouterr().out.strip()
    assert line == (f"not promoted: candidate version {worse} AUC {aucs[2]:.6f} < champion version {best} AUC "
                    f"{aucs[40]:.6f} + min gain 0 (gain {aucs[2] - aucs[40]:+.6f}) on {rows} rows of {data}/valid")
    assert champion(mlflow_uri, name) == best
    run = promote_runs(mlflow_uri, name)[0]
    assert run.data.tags["promoted"] == "false" and run.data.tags["champion_version_after"] == best
    assert run.data.metrics["candidate_auc"] == pytest.approx(aucs[2], abs=1e-9)
    assert run.data.metrics["champion_auc"] == pytest.approx(aucs[40], abs=1e-9)
    assert run.data.metrics["rows"] == rows == 3000 and run.data.params["split"] == "valid"
    version = mlflow.MlflowClient(mlflow_uri).get_model_version(name, worse)
    assert version.tags["ctrflow.promotion"].startswith(f"refused: candidate version {worse} AUC")


def test_min_gain_asks_for_a_real_improvement(mlflow_uri, trained):
    from ctrflow.promotion import promote

    data, name = trained / "data", MODEL + "-gain"
    first = register(mlflow_uri, name, trained / "ckpt40", data)
    assert promote(name, mlflow_uri, data=data).promoted
    same = register(mlflow_uri, name, trained / "ckpt40", data)  # the same weights: gain exactly 0

    refused = promote(name, mlflow_uri, data=data, min_gain=0.001)
    assert not refused.promoted and champion(mlflow_uri, name) == first
    assert refused.candidate_auc == refused.champion_auc and refused.rows == 3000

    assert promote(name, mlflow_uri, data=data, min_gain=0.0).promoted
    assert champion(mlflow_uri, name) == same


def test_a_candidate_at_chance_is_never_promoted(mlflow_uri, trained):
    from ctrflow.promotion import promote

    name = MODEL + "-at-chance"  # its own model: the test above leaves a champion on "-chance"
    register(mlflow_uri, name, trained / "ckpt40", trained / "data", auc=0.5)

    verdict = promote(name, mlflow_uri)  # no champion yet, and still refused

    assert not verdict.promoted and "at or below chance (0.5)" in verdict.reason
    assert "champion" not in mlflow.MlflowClient(mlflow_uri).get_registered_model(name).aliases


def test_a_candidate_that_cannot_score_the_holdout_is_refused_in_one_line(mlflow_uri, trained, tmp_path, capsys,
                                                                         monkeypatch):
    data, name = trained / "data", MODEL + "-unscorable"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    other = tmp_path / "other"  # a model of another dataset: its features are not the holdout's
    steps = [["synth", "--dataset", "movielens-like", "--rows", "1000", "--days", "2", "--seed", "1",
              "--out", str(tmp_path / "raw")],
             ["preprocess", "--dataset", str(tmp_path / "raw" / "movielens.yaml"), "--train",
              str(tmp_path / "raw" / "day_0.csv"), "--valid", str(tmp_path / "raw" / "day_1.csv"), "--out", str(other)],
             ["train", "--data", str(other), "--model", "dlrm", "--out", str(tmp_path / "ckpt"), "--max-steps", "2",
              "--batch-size", "128", "--embedding-dim", "8"]]
    for argv in steps:
        assert main(argv) == 0, f"ctrflow {argv[0]} failed"
    best = register(mlflow_uri, name, trained / "ckpt40", data)
    assert main(["promote", "--model", name, "--data", str(data), "--tracking-uri", mlflow_uri]) == 0
    stranger = register(mlflow_uri, name, tmp_path / "ckpt", other)
    capsys.readouterr()

    assert main(["promote", "--model", name, "--data", str(data), "--tracking-uri", mlflow_uri]) == 1

    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith(f"not promoted: candidate version {stranger} cannot score {data}/valid: the checkpoint was "
                          "trained on other features: dense features differ: only in the checkpoint age, price; "
                          "only here I1, I2, I3, I4 (+9 more)")
    assert champion(mlflow_uri, name) == best
