"""`ctrflow train --out DIR` where DIR holds a run: refused without --resume, started over with --overwrite;
flags that make no run (negative counts) refused before DIR is made."""

from __future__ import annotations

import json

import pytest

from ctrflow.cli import main
from tests.fixtures.training import write_processed


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("processed"), train_rows=1024, valid_rows=256, cardinality=20)


def train_argv(data_dir, out, *extra: str) -> list[str]:
    return ["train", "--data", str(data_dir), "--out", str(out), "--batch-size", "256", "--log-every", "1",
            "--no-progress", "--tracking-uri", "none", *extra]


def test_a_second_run_into_the_same_folder_is_refused_and_the_first_kept(data_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(train_argv(data_dir, out, "--max-steps", "3")) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert main(train_argv(data_dir, out, "--max-steps", "2")) == 2

    err = capsys.readouterr().err
    assert err == (f"ctrflow train: error: --out {out}: holds a training run (step_00000003); add --resume {out} "
                   f"to continue it or --overwrite to start over\n")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert (out / "metrics.jsonl").read_text() == metrics


def test_overwrite_removes_the_old_run_before_training(data_dir, tmp_path):
    out = tmp_path / "ckpt"
    assert main(train_argv(data_dir, out, "--max-steps", "4", "--checkpoint-every", "2")) == 0
    (out / "notes.txt").write_text("mine")  # not the run's: stays

    assert main(train_argv(data_dir, out, "--max-steps", "1", "--overwrite")) == 0

    assert sorted(p.name for p in out.glob("step_*")) == ["step_00000001"]
    assert (out / "latest").read_text().strip() == "step_00000001"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (out / "notes.txt").read_text() == "mine"


def test_resume_into_the_folder_continues_without_overwrite(data_dir, tmp_path):
    out = tmp_path / "ckpt"
    assert main(train_argv(data_dir, out, "--max-steps", "2")) == 0
    assert main(train_argv(data_dir, out, "--max-steps", "3", "--resume", str(out))) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_overwrite_and_resume_together_are_refused(data_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(train_argv(data_dir, out, "--max-steps", "1", "--overwrite", "--resume", str(out))) == 2
    assert "--overwrite starts over and --resume continues: give one of them" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--threads", "--max-steps", "--epochs"])
def test_a_negative_count_is_refused_in_one_line_before_any_output(data_dir, tmp_path, capsys, flag):
    out = tmp_path / "ckpt"
    assert main(train_argv(data_dir, out, flag, "-2")) == 2
    assert capsys.readouterr().err == f"ctrflow train: error: {flag} must not be negative, got -2\n"
    assert not out.exists()
