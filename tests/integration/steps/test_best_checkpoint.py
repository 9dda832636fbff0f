"""The best checkpoint by validation AUC: kept beside the last one, read by evaluate, export and
predict unless `--last`; early stopping; `--resume` continues from the last."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from ctrflow.checkpoint import dense_state, load_model
from ctrflow.cli import main
from tests.fixtures.serving import processed_data

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

# fast constant rates (no decay after the first epoch) on 600 noisy rows: the validation AUC goes up and
# down, and the last is not the best
SMALL = ["--batch-size", "64", "--embedding-dim", "4", "--bottom-mlp", "8", "--top-mlp", "8", "--lr", "0.02",
         "--sparse-lr", "0.2", "--decay-start-epoch", "none", "--eval-every", "3", "--no-progress",
         "--tracking-uri", "none"]


def train(data: Path, out: Path, *flags: str) -> None:
    assert main(["train", "--data", str(data), "--out", str(out), *SMALL, *flags]) == 0


def validations(out: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["auc"]) for r in records if "auc" in r]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(raw days, processed data, a 3-epoch run keeping 1 checkpoint, its validations, its MLflow store)."""
    raw, data = processed_data(tmp_path_factory)
    root = tmp_path_factory.mktemp("best")
    out, store = root / "run", f"sqlite:///{root}/mlflow.db"
    train(data, out, "--epochs", "3", "--keep-checkpoints", "1", "--tracking-uri", store)
    return raw, data, out, validations(out), store


def test_the_best_validation_is_kept_beside_the_last_and_summarized(run):
    import mlflow

    _, _, out, seen, store = run
    best_step, best_auc = max(seen, key=lambda v: v[1])
    last_step = seen[-1][0]
    assert best_step != last_step  # the setting above makes the last validation a worse one
    assert (out / "best").read_text().strip() == f"step_{best_step:08d}"
    assert (out / "latest").read_text().strip() == f"step_{last_step:08d}"
    # --keep-checkpoints 1 keeps the newest, and the best besides
    assert sorted(p.name for p in out.glob("step_*")) == [f"step_{best_step:08d}", f"step_{last_step:08d}"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert (summary["best_step"], summary["best_valid_auc"]) == (best_step, best_auc)
    assert summary["best_checkpoint"].endswith(f"step_{best_step:08d}") and summary["early_stopped"] is False
    [tracked] = mlflow.MlflowClient(store).search_runs(
        [mlflow.MlflowClient(store).get_experiment_by_name("ctrflow").experiment_id])
    assert tracked.data.metrics["best_valid_auc"] == pytest.approx(best_auc)
    assert tracked.data.metrics["best_step"] == best_step
    assert tracked.data.tags["best_checkpoint"] == summary["best_checkpoint"]


def test_evaluate_reads_the_best_and_last_on_request(run, tmp_path, capsys):
    _, data, out, seen, _ = run
    best_auc, last_auc = max(a for _, a in seen), seen[-1][1]
    capsys.readouterr()
    assert main(["evaluate", "--data", str(data), "--checkpoint", str(out), "--out", str(tmp_path / "e"),
                 "--device", "cpu", "--tracking-uri", "none"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["auc"] == pytest.approx(best_auc, abs=1e-6)
    assert main(["evaluate", "--data", str(data), "--checkpoint", str(out), "--last", "--out", str(tmp_path / "l"),
                 "--device", "cpu", "--tracking-uri", "none"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["auc"] == pytest.approx(last_auc, abs=1e-6)


def test_export_and_predict_read_the_best(run, tmp_path, capsys):
    raw, data, out, _, _ = run
    best_dir = out / (out / "best").read_text().strip()
    assert main(["export", "--checkpoint", str(out), "--data", str(data), "--out", str(tmp_path / "repo"),
                 "--backend", "python", "--validation-rows", "64", "--tracking-uri", "none"]) == 0
    [exported] = (tmp_path / "repo").glob("*/1/checkpoint/model.pt")
    dense = torch.load(exported, weights_only=True)["dense"]
    expected = dense_state(load_model(best_dir)[0])
    assert dense.keys() == expected.keys() and all(torch.equal(dense[k], expected[k]) for k in expected)
    scores = {}
    for name, flags in (("run", []), ("best", None), ("last", ["--last"])):
        ckpt = str(best_dir) if flags is None else str(out)
        assert main(["predict", "--checkpoint", ckpt, *(flags or []), "--data", str(data),
                     "--input", str(raw / "day_1.tsv"), "--out", str(tmp_path / f"{name}.parquet")]) == 0
        scores[name] = pq.read_table(tmp_path / f"{name}.parquet").column("probability").to_numpy()
    assert (scores["run"] == scores["best"]).all() and not (scores["run"] == scores["last"]).all()


def test_early_stopping_stops_after_n_validations_without_improvement_and_resume_takes_the_last(run, tmp_path,
                                                                                               capsys):
    data = run[1]
    out = tmp_path / "stopped"
    train(data, out, "--epochs", "20", "--early-stopping", "2")
    seen = validations(out)
    best_step, best_auc = max(seen, key=lambda v: v[1])
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["early_stopped"] is True and summary["step"] < 20 * 9  # 9 steps an epoch
    assert seen[-1][0] == summary["step"] == best_step + 2 * 3  # two validations (every 3 steps) after the best
    assert all(auc <= best_auc for _, auc in seen[-2:])
    assert (out / "best").read_text().strip() == f"step_{best_step:08d}"
    assert (out / "latest").read_text().strip() == f"step_{summary['step']:08d}"
    assert "early stopping" in capsys.readouterr().out
    # resuming continues from the last step, not the best one
    more = tmp_path / "more"
    train(data, more, "--epochs", "20", "--max-steps", str(summary["step"] + 3), "--resume", str(out))
    last = summary["step"]
    assert f"resumed from {out / f'step_{last:08d}'} at step {last}" in capsys.readouterr().out
    assert json.loads((more / "train_summary.json").read_text())["step"] == summary["step"] + 3


def test_a_nan_auc_is_never_the_best_and_patience_counts_validations_without_improvement():
    from ctrflow.train.best import BestCheckpoint

    best = BestCheckpoint(patience=2)
    assert not best.offer(1, float("nan")) and best.note(False) == "" and not best.stop  # one class only
    assert best.offer(2, 0.6) and best.offer(3, 0.61)
    assert not best.offer(4, 0.61) and not best.stop  # equal is no improvement
    assert not best.offer(5, 0.5) and best.stop and (best.step, best.auc) == (3, 0.61)
    assert best.note(False) == " (best 0.6100 at step 3); early stopping: 2 validations without improvement"
