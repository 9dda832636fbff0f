"""`ctrflow export --base`: the next version beside the served one, a consistent preprocess+model
pair, the delta of changed rows, atomic publication, retention, and bases of other models refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tests.fixtures.serving import FakeRequest, checkpoint, load_python_model, movielens_data, processed_data, raw_requests

from ctrflow.errors import UserError
from ctrflow.export import export
from ctrflow.export.delta import apply_delta
from ctrflow.export.triton import read_config
from ctrflow.export.validate import check_repository
from ctrflow.export.versions import served_version, version_numbers
from ctrflow.predict import predict

pytestmark = pytest.mark.integration

ROWS = slice(0, 60)
GROWN = "C1"  # the feature whose vocabulary grows on the new day
PERTURBED = [2, 3, 5]  # rows of the GROWN table the new day's training moved


def save_model(net, schema, out: Path, model: str = "dlrm") -> Path:
    """A checkpoint of `net` as the training code writes it (the architecture of `serving_fixtures.checkpoint`)."""
    from ctrflow.checkpoint import save_checkpoint
    from ctrflow.config import ModelConfig, TrainConfig
    from ctrflow.runtime import Runtime
    from ctrflow.train.optim import build_optimizers

    arch = ModelConfig.from_dict({"name": model, "embedding_dim": 4, "bottom_mlp": (8,), "top_mlp": (8,),
                                 "deep_mlp": (8,)})  # each model takes the widths it has
    config = TrainConfig(out=str(out), model=arch)
    save_checkpoint(out, net, build_optimizers(net, config.optim), {"step": 1, "epoch": 0, "batch": 0},
                    config, schema, Runtime(0, 1, 0, torch.device("cpu")))
    return out


def grow_vocabulary(data: Path, raw_rows: dict, out: Path) -> tuple[Path, list[str]]:
    """A copy of `data` whose GROWN vocabulary gained the values the raw rows hold but it read as
    unseen: what the next day's preprocessing with the previous vocabulary gives (old ids kept)."""
    from ctrflow.contract.vocab import Vocabularies
    from ctrflow.contract.schema import Schema

    shutil.copytree(data, out)
    old = Vocabularies.load(data)
    values = [v[0].decode() for v in raw_rows[GROWN]]
    ids = old.encode(GROWN, values)
    new = sorted({v for v, i in zip(values, ids) if i == 1})[:5]
    assert new, "the sample rows hold no unseen value to grow the vocabulary with"
    table = pq.read_table(out / "vocab" / f"{GROWN}.parquet")
    added = pa.table({"value": pa.array(new, table.schema.field("value").type),
                      "count": pa.array([1] * len(new), pa.int64())})
    pq.write_table(pa.concat_tables([table, added]), out / "vocab" / f"{GROWN}.parquet")
    schema = Schema.load(data)
    cards = dict(schema.cardinalities, **{GROWN: schema.cardinalities[GROWN] + len(new)})
    raw = json.loads((data / "schema.json").read_text())
    raw["cardinalities"] = cards
    for feature in raw["features"]["sparse"]:
        feature["cardinality"] = cards[feature["name"]]
    (out / "schema.json").write_text(json.dumps(raw))
    raw["vocab_hash"] = Vocabularies.load(out).hash()
    (out / "schema.json").write_text(json.dumps(raw))
    return out, new


def next_day_model(base_ckpt: Path, data: Path, out: Path, seed: int = 7) -> Path:
    """A checkpoint for the grown `data`: the base's weights, grown tables (new rows fresh), a few
    rows of GROWN and every dense weight moved, as a day of training would."""
    from ctrflow.checkpoint import load_model
    from ctrflow.models import build_model
    from ctrflow.contract.schema import Schema

    old, _, meta = load_model(base_ckpt)
    schema = Schema.load(data)
    net = build_model(meta["model"]["name"], schema, 4, seed=seed, **meta["model"]["arch"])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, table in net.embeddings.weights.items():
            before = old.embeddings.weights[name]
            table[:len(before)] = before
        net.embeddings.weights[f"t_{GROWN}"][PERTURBED] += torch.randn(len(PERTURBED), 4, generator=generator)
        for name, value in net.named_parameters():
            if not name.startswith("embeddings."):
                value.copy_(dict(old.named_parameters())[name] + 0.05 * torch.randn(value.shape, generator=generator))
    return save_model(net, schema, out)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Day 0 (processed data, checkpoint) and day 1 (grown vocabulary, moved weights), raw rows, and
    `ctrflow predict` of both on them."""
    raw, data = processed_data(tmp_path_factory)
    base_ckpt = checkpoint(tmp_path_factory)
    root = tmp_path_factory.mktemp("versions")
    lines = (raw / "day_1.tsv").read_bytes().split(b"\n")[ROWS]
    (root / "rows.tsv").write_bytes(b"\n".join(lines) + b"\n")
    rows = raw_requests(root / "rows.tsv", data, slice(0, 60))
    grown, added = grow_vocabulary(data, rows, root / "data-1")
    new_ckpt = next_day_model(base_ckpt, grown, root / "ckpt-1")
    scores = {}
    for day, (ckpt, d) in enumerate([(base_ckpt, data), (new_ckpt, grown)]):
        predict(ckpt, d, [root / "rows.tsv"], root / f"scores-{day}.parquet")
        scores[day] = pq.read_table(root / f"scores-{day}.parquet").column("probability").to_numpy()
    return {"root": root, "rows": rows, "data": [data, grown], "ckpt": [base_ckpt, new_ckpt], "added": added,
            "scores": scores}


def first_export(days, repo: Path, backend: str = "python") -> dict:
    return export(days["ckpt"][0], days["data"][0], repo, "ctr", backend=backend, max_batch_size=64,
                  validation_rows=100)


def next_export(days, repo: Path, **kwargs) -> dict:
    return export(days["ckpt"][1], days["data"][1], kwargs.pop("out", repo), "ctr", base=repo,
                  validation_rows=100, **kwargs)


def served_scores(monkeypatch, repo: Path, version: int, rows: dict) -> np.ndarray:
    """The ensemble's two python models of `version` on the raw rows, as Triton chains them."""
    pre = load_python_model(monkeypatch, repo / "ctr_preprocess" / str(version) / "model.py")
    features = pre.execute([FakeRequest(rows)])[0]
    assert features.error is None
    tensors = {t.name(): t.as_numpy() for t in features.output_tensors}
    model = load_python_model(monkeypatch, repo / "ctr_model" / str(version) / "model.py")
    ranked = model.execute([FakeRequest(tensors)])[0]
    assert ranked.error is None, ranked.error
    return ranked.output("probability")[:, 0]


def tree_digest(root: Path) -> str:
    """One hash over every file's path and bytes under `root`."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def test_next_version_is_written_beside_and_the_ensemble_pins_the_new_pair(days, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    first_export(days, repo)
    v1 = tree_digest(repo / "ctr_model" / "1") + tree_digest(repo / "ctr_preprocess" / "1")
    summary = next_export(days, repo)

    assert summary["version"] == 2 and summary["base_version"] == 1
    assert version_numbers(repo / "ctr_model") == version_numbers(repo / "ctr_preprocess") == [1, 2]
    assert tree_digest(repo / "ctr_model" / "1") + tree_digest(repo / "ctr_preprocess" / "1") == v1
    ensemble = check_repository(repo, "ctr")["ctr"]
    assert [(s.model_name, s.model_version) for s in ensemble.ensemble_scheduling.step] == \
        [("ctr_preprocess", 2), ("ctr_model", 2)]
    assert read_config(repo / "ctr_model" / "config.pbtxt").version_policy.latest.num_versions == 2
    vocab = pq.read_table(repo / "ctr_preprocess" / "2" / "vocab" / f"{GROWN}.parquet").column("value").to_pylist()
    assert vocab[-len(days["added"]):] == days["added"]  # the vocabularies are versioned with the model
    # each version scores the raw rows as its own checkpoint does; the grown values change scores
    assert np.abs(served_scores(monkeypatch, repo, 2, days["rows"]) - days["scores"][1]).max() <= 1e-5
    assert np.abs(served_scores(monkeypatch, repo, 1, days["rows"]) - days["scores"][0]).max() <= 1e-5
    assert np.abs(days["scores"][1] - days["scores"][0]).max() > 1e-3


def test_delta_holds_the_changed_and_added_rows_and_rebuilds_the_new_weights(days, tmp_path):
    from ctrflow.checkpoint import load_model, model_state

    repo = tmp_path / "repo"
    first_export(days, repo)
    summary = next_export(days, repo)["delta"]

    delta_dir = repo / "ctr_model" / "2" / "delta"
    record = json.loads((delta_dir / "delta.json").read_text())
    grown = record["tables"][f"embeddings.t_{GROWN}"]
    assert grown["base_rows"] + len(days["added"]) == grown["rows"]
    assert np.load(delta_dir / grown["ids"]).tolist() == PERTURBED + list(range(grown["base_rows"], grown["rows"]))
    untouched = [t for name, t in record["tables"].items() if name != f"embeddings.t_{GROWN}"]
    assert untouched and all(t["changed"] == 0 for t in untouched)
    assert summary["changed_rows"] == len(PERTURBED) + len(days["added"])
    assert 0 < summary["delta_bytes"] < summary["full_bytes"] and summary == {k: record[k] for k in summary}

    base = torch.load(repo / "ctr_model" / "1" / "checkpoint" / "model.pt", weights_only=True)
    rebuilt = apply_delta(base, delta_dir)
    expected = model_state(load_model(days["ckpt"][1])[0])
    assert rebuilt["tables"].keys() == expected["tables"].keys()
    for name, weight in expected["tables"].items():
        assert torch.equal(rebuilt["tables"][name], weight), name
    for name, weight in expected["dense"].items():
        assert torch.equal(rebuilt["dense"][name], weight), name


def test_an_export_that_dies_midway_leaves_the_served_version(days, tmp_path, monkeypatch):
    import ctrflow.export.incremental as incremental

    repo = tmp_path / "repo"
    first_export(days, repo)
    before = tree_digest(repo)

    def die(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(incremental, "write_delta", die)  # staging: writing the delta fails
    with pytest.raises(OSError, match="disk full"):
        next_export(days, repo)
    assert tree_digest(repo) == before
    monkeypatch.undo()

    real = incremental.replace_file

    def crash_at_the_pin(source, target):  # the versions are in place, the ensemble not yet switched
        if target == repo / "ctr" / "config.pbtxt":
            raise KeyboardInterrupt("killed")
        real(source, target)

    monkeypatch.setattr(incremental, "replace_file", crash_at_the_pin)
    with pytest.raises(KeyboardInterrupt):
        next_export(days, repo)
    monkeypatch.undo()
    assert version_numbers(repo / "ctr_model") == [1, 2]  # debris of the dead export
    assert served_version(repo, "ctr") == 1
    check_repository(repo, "ctr")
    assert np.abs(served_scores(monkeypatch, repo, 1, days["rows"]) - days["scores"][0]).max() <= 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no staging folder left

    summary = next_export(days, repo)  # the next export clears the debris and completes
    assert summary["version"] == 2 and len(summary["dropped_unfinished"]) == 2
    assert served_version(repo, "ctr") == 2


def test_the_newest_versions_are_kept(days, tmp_path):
    repo = tmp_path / "repo"
    first_export(days, repo)
    assert next_export(days, repo)["pruned_versions"] == []
    assert next_export(days, repo)["pruned_versions"] == [1]
    summary = next_export(days, repo, keep_versions=1)
    assert summary["version"] == 4 and summary["pruned_versions"] == [2, 3]
    assert version_numbers(repo / "ctr_model") == version_numbers(repo / "ctr_preprocess") == [4]
    assert json.loads((repo / "ctr_model" / "4" / "delta" / "delta.json").read_text())["base_version"] == 3
    with pytest.raises(UserError, match="--keep-versions must be at least 1"):
        next_export(days, repo, keep_versions=0)


def test_out_other_than_base_gets_the_base_plus_the_next_version(days, tmp_path):
    base = tmp_path / "base"
    first_export(days, base, backend="onnxruntime")
    before = tree_digest(base)
    summary = next_export(days, base, out=tmp_path / "out")
    assert summary["version"] == 2 and summary["backend"] == "onnxruntime"  # the base's backend
    assert tree_digest(base) == before
    assert version_numbers(tmp_path / "out" / "ctr_model") == [1, 2]
    assert (tmp_path / "out" / "ctr_model" / "2" / "model.onnx").exists()
    assert (tmp_path / "out" / "ctr_model" / "2" / "delta" / "delta.json").exists()
    assert "torch" not in (tmp_path / "out" / "requirements.txt").read_text()
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["max_abs_diff"] <= 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "out"]


def test_a_base_of_another_model_is_refused_naming_the_difference(days, tmp_path, tmp_path_factory):
    repo = tmp_path / "repo"
    first_export(days, repo)
    before = tree_digest(repo)
    with pytest.raises(UserError, match=r"--base .*repo: no ensemble 'other' \(it holds ctr, ctr_model"):
        export(days["ckpt"][1], days["data"][1], repo, "other", base=repo)
    deepfm = checkpoint(tmp_path_factory, "deepfm", days["data"][0])
    with pytest.raises(UserError, match=r"another architecture: model dlrm there, deepfm here"):
        export(deepfm, days["data"][0], repo, "ctr", base=repo)
    _, movies = movielens_data(tmp_path_factory)
    with pytest.raises(UserError, match=r"serves other features: dense features \['I1'.*there, \['age', 'price'\] here"):
        export(checkpoint(tmp_path_factory, "dlrm", movies), movies, repo, "ctr", base=repo)
    with pytest.raises(UserError, match=r"--backend onnxruntime: the base repository's model is exported with python"):
        next_export(days, repo, backend="onnxruntime")
    assert tree_digest(repo) == before


def test_cli_prints_the_version_and_the_delta_sizes(days, tmp_path, capsys, monkeypatch):
    from ctrflow.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    repo = tmp_path / "repo"
    first_export(days, repo)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(days["ckpt"][1]), "--data", str(days["data"][1]),
                 "--base", str(repo), "--validation-rows", "50"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["version"] == 2 and summary["repository"] == str(repo)
    assert summary["delta"]["changed_rows"] == len(PERTURBED) + len(days["added"])
    assert 0 < summary["delta"]["delta_bytes"] < summary["delta"]["full_bytes"]


def test_loading_a_version_leaves_its_folder_unchanged(days, tmp_path, monkeypatch):
    """A server polling the repository reloads a model whose folder changed: importing model.py
    must not write bytecode beside it."""
    repo = tmp_path / "repo"
    first_export(days, repo)
    before = tree_digest(repo)
    served_scores(monkeypatch, repo, 1, days["rows"])
    assert tree_digest(repo) == before
    assert not (repo / "ctr_model" / "1" / "__pycache__").is_dir()
