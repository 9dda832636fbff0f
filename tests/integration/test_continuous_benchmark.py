"""benchmarks/continuous.py end to end on tiny drifting days: the daily loop (`preprocess --vocab-from`,
`train --init-from`) against the frozen and the from-scratch model, one JSON line, the plot, and the
figures in MLflow."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "continuous.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("continuous", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_two_days_print_one_json_line_write_the_plot_and_log_to_mlflow(tmp_path, capsys):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    work = tmp_path / "work"
    bench = load_benchmark()
    assert bench.main(["--out", str(work), "--rows", "4000", "--days", "3", "--drift", "0.2", "--batch-size", "512",
                       "--workers", "1", "--tracking-uri", uri]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert record == json.loads((work / "continuous.json").read_text())
    assert [json.loads(line)["day"] for line in lines[:-1]] == [1, 2]  # one short line per later day
    assert (work / "continuous.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    days = record["days"]
    assert [d["day"] for d in days] == [0, 1, 2] and [d["scored_on"] for d in days] == [1, 2, 3]
    for before, after in itertools.pairwise(days):
        # the continuous model's tables grew with the vocabulary, every row of the new ones counted
        assert all(after["cardinalities"][f] >= before["cardinalities"][f] for f in before["cardinalities"])
        assert after["cardinalities"]["userId"] > before["cardinalities"]["userId"]
        assert after["checkpoint_delta"]["rows"] == sum(after["cardinalities"].values())
        delta = after["checkpoint_delta"]
        assert 0 < delta["changed_rows"] <= delta["rows"]
        assert delta["changed_bytes"] <= delta["model_bytes"] + 8 * delta["changed_rows"]  # + an id per changed row
    for d in days:
        assert all(0.5 < d[k] < 1 for k in ("continuous", "frozen", "scratch"))
        assert d["continuous_train"]["seconds"] > 0 and d["scratch_train"]["seconds"] > 0
    assert days[0]["continuous"] == days[0]["frozen"] == days[0]["scratch"]  # day 0: one model for all three
    assert days[1]["frozen"] != days[1]["continuous"]
    assert record["met"] == all(record["targets"].values()) and len(record["targets"]) == 4
    # the same figures in MLflow: AUCs per day as steps, the JSON and the plot as artifacts
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("ctrflow-benchmarks")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "auc_continuous")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(d["day"], d["continuous"])
                                                                                   for d in days]
    assert run.data.params["rows_per_day"] == "4000"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"continuous.json", "continuous.png"}
