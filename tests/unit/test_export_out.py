"""`ctrflow export --out`: a new or empty folder, or a Triton model repository (the ensemble is added,
other models stay); a file or any other non-empty folder is refused in one line before any work."""

from __future__ import annotations

import pytest
from tests.fixtures.serving import checkpoint, processed_data

from ctrflow.cli import main


@pytest.fixture
def inputs(tmp_path_factory, monkeypatch):
    _, data = processed_data(tmp_path_factory)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    return checkpoint(tmp_path_factory), data


def export_argv(inputs, out, *extra: str) -> list[str]:
    ckpt, data = inputs
    return ["export", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(out), "--name", "ctr",
            "--backend", "python", "--validation-rows", "50", *extra]


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if the export starts loading the checkpoint: the check must come first."""
    import ctrflow.predict

    def loading(*args, **kwargs):
        raise AssertionError("export began its work before refusing --out")
    monkeypatch.setattr(ctrflow.predict, "load_for_data", loading)


def test_an_existing_file_is_refused_before_any_work(inputs, tmp_path, capsys, no_work):
    target = tmp_path / "repo"
    target.write_text("keep me")
    assert main(export_argv(inputs, target)) == 2
    assert capsys.readouterr().err == (f"ctrflow export: error: --out {target}: is a file; give a folder for the "
                                       f"Triton model repository\n")
    assert target.read_text() == "keep me"


def test_a_non_empty_folder_that_is_not_a_repository_is_refused(inputs, tmp_path, capsys, no_work):
    target = tmp_path / "mine"
    (target / "photos").mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    assert main(export_argv(inputs, target)) == 2
    assert capsys.readouterr().err == (
        f"ctrflow export: error: --out {target}: not empty and not a Triton model repository (notes.txt is not a "
        f"model folder with config.pbtxt); give a new or empty folder, or a repository to add the ensemble to\n")
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt", "photos"]


def test_a_triton_repository_gets_the_ensemble_added_and_keeps_its_other_models(inputs, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(export_argv(inputs, repo)) == 0
    (repo / "other_model" / "1").mkdir(parents=True)
    (repo / "other_model" / "config.pbtxt").write_text('name: "other_model"\nbackend: "python"\n')
    (repo / "ctr_model" / "1" / "stale.txt").write_text("from the earlier export")

    assert main(export_argv(inputs, repo)) == 0  # the same ensemble again: replaced

    assert sorted(p.name for p in repo.iterdir()) == ["ctr", "ctr_model", "ctr_preprocess", "other_model",
                                                      "requirements.txt", "validation.json"]
    assert not (repo / "ctr_model" / "1" / "stale.txt").exists()
    assert (repo / "other_model" / "config.pbtxt").exists()


def test_an_empty_folder_is_a_new_repository(inputs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(export_argv(inputs, empty)) == 0
    assert (empty / "ctr" / "config.pbtxt").exists()
