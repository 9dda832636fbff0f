"""The tuning stage's components without a pipeline: `tune` is a no-op at 0 trials and refuses a
threshold search; `train` trains a tuned config file's text in place of its flags."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("kfp")

from kfp import dsl  # noqa: E402

import ctrflow_components as components  # noqa: E402
from tests.fixtures.training import write_processed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


def test_tune_with_no_trials_does_nothing(tmp_path):
    study = tmp_path / "study"
    best = components.tune.python_func(data=dsl.Dataset(uri=str(tmp_path / "absent")),
                                       study=dsl.Artifact(uri=str(study)), trials=0, parallel=2,
                                       space="lr: {low: 0.001, high: 0.01}")
    assert best == "" and not study.exists()


def test_tune_refuses_a_threshold_search_the_later_tasks_could_not_follow(tmp_path):
    with pytest.raises(ValueError, match="freq_threshold is the pipeline's own"):
        components.tune.python_func(data=dsl.Dataset(uri=str(tmp_path / "absent")),
                                    study=dsl.Artifact(uri=str(tmp_path / "study")), trials=4, parallel=2,
                                    space="freq_threshold: {low: 2, high: 8}\nlr: {low: 0.001, high: 0.01}")


def test_train_trains_the_tuned_config_instead_of_its_flags(tmp_path):
    data = write_processed(tmp_path / "data", train_rows=512, valid_rows=256, cardinality=8)
    checkpoint = dsl.Model(uri=str(tmp_path / "ckpt"))
    tuned = ("model: {name: deepfm, embedding_dim: 4, dropout: 0.2}\noptim: {lr: 0.02}\n"
             "data: {batch_size: 128}\nmax_steps: 3\nseed: 7\n")
    components.train.python_func(data=dsl.Dataset(uri=str(data)), checkpoint=checkpoint, model="dlrm",
                                 batch_size=256, embedding_dim=16, tracking_uri="none", config=tuned)
    asked = json.loads((tmp_path / "ckpt" / "config.json").read_text())["asked"]
    assert asked["model"]["name"] == "deepfm" and asked["model"]["embedding_dim"] == 4
    assert asked["optim"]["lr"] == 0.02 and asked["data"]["batch_size"] == 128 and asked["seed"] == 7
    assert asked["data"]["path"] == str(data) and checkpoint.metadata["tuned"] is True
    assert checkpoint.metadata["steps"] == 3
