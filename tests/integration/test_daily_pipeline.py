"""The daily KFP pipeline run by the local runner over three small drifting synthetic days, in order:
day 0 trains from scratch and is served as version 1; day 1 grows the vocabularies, warm-starts the
champion and is promoted (served as version 2, with its delta); day 2 asks for an AUC gain no model
can make and is refused: the champion, the served version and the registry alias stay, the
vocabulary moves on. Tracked in a SQLite MLflow store (the registry the gate reads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest.importorskip("kfp")
mlflow = pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[2]
NAME = "movies"


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """The three days run in two calls (the third day with --min-gain 1); returns paths and each day's headline."""
    from ctrflow.synth.movielens import synthesize
    from ctrflow_pipelines.local import run_days

    tmp = tmp_path_factory.mktemp("daily")
    synthesize(tmp / "raw", rows=2000, days=3, seed=11, drift=0.2)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    arguments = {"state": str(tmp / "state"), "raw_dir": str(tmp / "raw"), "dataset": "movielens.yaml",
                 "holdout_fraction": 0.25, "model": "dlrm", "batch_size": 256, "embedding_dim": 8, "max_steps": 16,
                 "model_name": NAME, "export_backend": "python", "mlflow_tracking_uri": uri}
    cwd = os.getcwd()
    os.chdir(REPO)  # the tasks import the repository's packages
    try:
        # min gain -1: day 1 passes the gate whatever its AUC above chance
        days = list(run_days(tmp / "root", {**arguments, "min_gain": -1.0}, ["day_0.*", "day_1.*"]))
        days += list(run_days(tmp / "root", {**arguments, "min_gain": 1.0}, ["day_2.*"]))
    finally:
        os.chdir(cwd)
    return {"tmp": tmp, "uri": uri, "days": days, "state": tmp / "state"}


def served_version(repository: Path) -> int:
    from ctrflow.export.versions import served_version as served

    return served(repository, NAME)


def test_each_day_grows_the_vocabulary_of_the_day_before(loop):
    from ctrflow.contract.schema import Schema

    runs = [Path(day["run_dir"]) for day in loop["days"]]
    schemas = [Schema.load(run / "preprocess-day" / "data") for run in runs]
    assert schemas[0].parent is None  # the first day: vocabularies from scratch
    for before, after in zip(schemas, schemas[1:]):
        assert after.parent["vocab_hash"] == before.vocab_hash
        assert all(after.cardinalities[k] >= n for k, n in before.cardinalities.items())
    assert schemas[2].cardinalities["movieId"] > schemas[0].cardinalities["movieId"]  # new movies came
    assert [day["day"] for day in loop["days"]] == [1, 2, 3]


def test_warm_start_from_the_champion_and_promotion_on_the_day_holdout(loop):
    from ctrflow.contract.schema import Schema

    day0, day1, day2 = loop["days"]
    holdout = Schema.load(Path(day2["run_dir"]) / "preprocess-day" / "data").rows["valid"]
    assert day0["promoted"] and day1["promoted"] and not day2["promoted"]
    assert day0["verdict"]["reason"].startswith("no champion yet")
    assert day1["verdict"]["champion_version"] == "1" and day1["verdict"]["candidate_version"] == "2"
    assert 300 <= holdout <= 700 and day2["verdict"]["rows"] == holdout  # about a quarter of the day's 2000 rows
    assert "min gain 1" in day2["verdict"]["reason"]
    trained = json.loads((Path(day1["run_dir"]) / "train" / "executor_output.json").read_text())
    meta = trained["artifacts"]["checkpoint"]["artifacts"][0]["metadata"]
    assert meta["init_from"] == str(loop["state"] / "checkpoints" / "day-0001")


def test_the_served_repository_moves_only_on_promotion(loop):
    repository = loop["state"] / "repository"
    assert served_version(repository) == 2  # day 0 -> 1, day 1 -> 2, day 2 refused
    delta = json.loads((repository / f"{NAME}_model" / "2" / "delta" / "delta.json").read_text())
    assert delta["base_version"] == 1 and delta["added_rows"] > 0 and delta["delta_bytes"] > 0  # new users, movies
    state = json.loads((loop["state"] / "state.json").read_text())
    assert state["champion"] == "checkpoints/day-0002" and state["vocabulary"] == "vocabularies/day-0003"
    # the refused day's candidate was exported beside the served version, in its own artifact only
    exported = json.loads((Path(loop["days"][2]["run_dir"]) / "export" / "executor_output.json").read_text())
    assert exported["artifacts"]["repository"]["artifacts"][0]["metadata"]["version"] == 3


def test_the_registry_and_mlflow_record_each_decision(loop):
    client = mlflow.MlflowClient(loop["uri"], registry_uri=loop["uri"])
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "2"
    assert str(client.get_model_version_by_alias(NAME, "candidate").version) == "3"
    experiment = client.get_experiment_by_name("ctrflow-daily")
    gates = client.search_runs([experiment.experiment_id], "tags.`ctrflow.step` = 'promote'",
                               order_by=["attributes.start_time ASC"])
    assert [run.data.tags["promoted"] for run in gates] == ["true", "true", "false"]
    last = gates[-1].data
    assert last.metrics["rows"] == loop["days"][2]["verdict"]["rows"] and last.params["min_gain"] == "1.0"
    assert 0.5 < last.metrics["champion_auc"] < 1.0 and "candidate_auc" in last.metrics
    assert last.tags["champion_version_after"] == "2"
