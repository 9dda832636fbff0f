"""The registry against a real `mlflow server` on 127.0.0.1: the raw-rows pyfunc that each export
registers, and `ctrflow promote`'s AUC gate on the `champion` alias."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.schema import Schema
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
    """Synthetic data, preprocessed, and two checkpoints of it (2 and 40 steps)."""
    tmp = tmp_path_factory.mktemp("registry")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        steps = [
            ["synth", "--rows", "3000", "--days", "2", "--seed", "5", "--out", str(tmp / "raw")],
            ["preprocess", "--train", str(tmp / "raw" / "day_0.tsv"), "--valid", str(tmp / "raw" / "day_1.tsv"),
             "--out", str(tmp / "data"), "--freq-threshold", "2"],
            *[["train", "--data", str(tmp / "data"), "--model", "dlrm", "--out", str(tmp / f"ckpt{n}"),
               "--max-steps", str(n), "--batch-size", "128", "--embedding-dim", "8"] for n in (2, 40)],
        ]
        for argv in steps:
            assert main(argv) == 0, f"ctrflow {argv[0]} failed"
    return tmp


def register(uri: str, name: str, checkpoint: Path, data: Path, auc: float | None = None) -> str:
    """What an export does: a run with the raw-rows pyfunc, registered as the new candidate."""
    from ctrflow.registry import log_pyfunc
    from ctrflow.tracking.mlflow_tracker import MlflowTracker

    with MlflowTracker(uri, "registry-test", run_name="export") as tracker:
        if auc is not None:
            tracker.log_metrics({"auc": auc})
        assert log_pyfunc(tracker, checkpoint, data) == "model"
        return tracker.register_model(name, "model")


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


def test_promote_reads_the_auc_of_the_evaluate_step_of_the_same_pipeline_run(mlflow_uri, trained):
    from ctrflow.registry import log_pyfunc, promote
    from ctrflow.tracking.mlflow_tracker import MlflowTracker

    name = MODEL + "-pipeline"
    with MlflowTracker(mlflow_uri, "registry-test", run_name="pipeline") as pipeline:
        steps = {"parent_run_id": pipeline.run_id}
        with MlflowTracker(mlflow_uri, "registry-test", "evaluate", tags={"ctrflow.step": "evaluate"}, **steps) as ev:
            ev.log_metrics({"auc": 0.7345})
        with MlflowTracker(mlflow_uri, "registry-test", "export", tags={"ctrflow.step": "export"}, **steps) as ex:
            ex.register_model(name, log_pyfunc(ex, trained / "ckpt40", trained / "data"))

    verdict = promote(name, mlflow_uri)

    assert verdict.promoted and verdict.candidate_auc == pytest.approx(0.7345)
    assert champion(mlflow_uri, name) == verdict.candidate_version


def test_promote_recomputes_both_aucs_on_the_evaluation_data(mlflow_uri, trained, capsys):
    from ctrflow.evaluate import evaluate
    from ctrflow.registry import promote

    data = trained / "data"
    aucs = {n: evaluate(data, trained / f"ckpt{n}", trained / f"eval{n}")["auc"] for n in (2, 40)}
    name = MODEL + "-recompute"
    register(mlflow_uri, name, trained / "ckpt2", data)
    assert main(["promote", "--model", name, "--tracking-uri", mlflow_uri, "--data", str(data)]) == 0
    register(mlflow_uri, name, trained / "ckpt40", data)

    verdict = promote(name, mlflow_uri, data=data, split="valid")

    assert verdict.candidate_auc == pytest.approx(aucs[40], abs=1e-9)
    assert verdict.champion_auc == pytest.approx(aucs[2], abs=1e-9)
    assert verdict.promoted == (aucs[40] >= aucs[2])
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
