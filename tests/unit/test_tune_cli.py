"""`ctrflow tune`: bad input is a one-line error before any trial starts; a trial's config and its
metrics file as the study reads them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

pytest.importorskip("optuna")

from ctrflow.cli import main  # noqa: E402
from ctrflow.config import DataConfig, TrainConfig  # noqa: E402
from ctrflow.contract.schema import Schema  # noqa: E402
from ctrflow.processes import process_alive  # noqa: E402
from ctrflow.tune.trial import TrialProcess, slot_env, trial_config  # noqa: E402
from tests.fixtures.training import write_processed  # noqa: E402

GOOD_SPACE = "lr: {low: 0.001, high: 0.01, log: true}\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = write_processed(tmp_path_factory.mktemp("processed"), train_rows=1024, valid_rows=512, cardinality=10)
    schema = Schema.load(root)
    Schema(**{**schema.__dict__, "freq_threshold": 4}).save(root / "schema.json")  # as if preprocessed at 4
    return root


def run_tune(capsys, data, out, space_text, *extra):
    space = out.parent / "space.yaml"
    space.write_text(space_text)
    code = main(["tune", "--data", str(data), "--model", "dlrm", "--space", str(space), "--out", str(out),
                 "--tracking-uri", "none", *extra])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("space_text, extra, message", [
    ("learning_rate: {low: 0.001, high: 0.01}\n", (), "unknown field 'learning_rate'"),
    ("lr: {low: 0.01, high: 0.001}\n", (), "lr: empty range: low 0.01 > high 0.001"),
    ("embedding_dim: {choices: []}\n", (), "embedding_dim: choices must be a non-empty list"),
    (GOOD_SPACE, ("--trials", "4", "--parallel", "8"), "--parallel 8 is larger than --trials 4"),
    ("freq_threshold: {low: 2, high: 10}\n", (),
     "freq_threshold: 2 is below the threshold .* was preprocessed with \\(4\\).*preprocess with a lower "
     "--freq-threshold"),
    ("freq_threshold: {choices: [8, 3]}\n", (), "freq_threshold: 3 is below the threshold"),
])
def test_bad_input_is_one_line_before_any_trial(capsys, data, tmp_path, space_text, extra, message):
    out = tmp_path / "study"
    code, err = run_tune(capsys, data, out, space_text, *extra)
    assert code == 2
    assert err.startswith("ctrflow tune: error: ") and "\n" not in err and "Traceback" not in err
    assert re.search(message, err), err
    assert not (out / "trials").exists()


def test_data_without_a_validation_split_is_refused(capsys, data, tmp_path):
    copy = tmp_path / "no_valid"
    shutil.copytree(data, copy)
    shutil.rmtree(copy / "valid")
    code, err = run_tune(capsys, copy, tmp_path / "study", GOOD_SPACE)
    assert code == 2 and "no validation split" in err and "\n" not in err


def test_a_trial_config_validates_a_fixed_number_of_times_per_epoch(tmp_path):
    base = TrainConfig(data=DataConfig(path="ignored", batch_size=256), seed=7, eval_every=1000)
    config = trial_config(base, {"optim.lr": 0.004, "model.top_mlp": (32, 16), "freq_threshold": 9},
                          tmp_path / "view", tmp_path / "trial", train_rows=10_000, evals_per_epoch=4, threads=1)
    assert config.optim.lr == 0.004 and config.model.arch.top_mlp == (32, 16) and config.seed == 7
    assert config.data.path == str(tmp_path / "view") and config.out == str(tmp_path / "trial")
    assert config.eval_every == 10  # 39 steps an epoch / 4, rounded up: validations at 10, 20, 30, 39
    assert config.threads == 1 and config.progress is False
    bigger = trial_config(base, {"data.batch_size": 1024}, "d", "o", 10_000, 4, None)
    assert bigger.eval_every == 3  # 9 steps: 3, 6, 9 and the end: the same shares of the epoch


def test_the_metrics_file_is_read_as_it_grows(tmp_path):
    process = TrialProcess(0, tmp_path, TrainConfig(), process=None, slot=0)
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 0.7}) + "\n" + json.dumps({"step": 5, "auc": 0.61}) + "\n"
                    + '{"step": 10, "au')  # a line still being written
    assert process.new_values() == [(1, 5, 0.61)]
    with open(path, "a") as f:
        f.write('c": 0.65, "valid_logloss": 0.5}\n')
    assert process.new_values() == [(2, 10, 0.65)]
    assert process.new_values() == []
    assert process.values == [(5, 0.61), (10, 0.65)]


def test_gpus_are_split_between_slots():
    assert slot_env(0, 2, ["0", "1", "2", "3"]) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert slot_env(1, 2, ["0", "1", "2", "3"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert slot_env(2, 3, ["5", "7"]) == {"CUDA_VISIBLE_DEVICES": "5"}  # more slots than GPUs: shared
    assert slot_env(1, 2, []) == {}


def test_an_exited_unreaped_process_is_not_alive():
    """A tuning process that was killed but not yet reaped (a zombie) runs no trial: its trials are
    recovered at once, not after the heartbeat's grace period."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_alive(child.pid) and time.monotonic() < deadline:  # exited, not waited for: a zombie
        time.sleep(0.05)
    assert not process_alive(child.pid)
    child.wait()
    assert process_alive(os.getpid())


def test_a_study_recorded_with_every_models_fields_continues(data, tmp_path):
    """A study started when `model:` listed every model's fields opens again with today's config."""
    from ctrflow.tune.space import parse_space
    from ctrflow.tune.study import SETTINGS_ATTR, StudySettings, open_study

    settings = StudySettings(data=data, base=TrainConfig.from_dict({"model": {"name": "dlrm"}}),
                             space=parse_space({"lr": {"low": 0.001, "high": 0.01}}, "space"), out=tmp_path)
    study = open_study(settings, trials=2)
    old = json.loads(json.dumps(settings.record()))
    old["base"]["model"].update({"cross_layers": 3, "cross_rank": 0, "deep_mlp": [128, 64]})
    study.optuna.set_user_attr(SETTINGS_ATTR, old)
    assert open_study(settings, trials=2).name == study.name
    old["base"]["model"]["embedding_dim"] = 8  # a real difference is still refused
    study.optuna.set_user_attr(SETTINGS_ATTR, old)
    with pytest.raises(Exception, match="another base"):
        open_study(settings, trials=2)
