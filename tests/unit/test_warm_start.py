"""`ctrflow train --init-from CKPT`: a warm start on the next day's data, whose vocabularies grew
(`preprocess --vocab-from`). Before any step the model scores old rows exactly as the checkpoint does,
new rows are what a fresh model draws, their optimizer state is zero, the output bias is the
checkpoint's; the fused path and other optimizer kinds load it; and data that does not descend from
the checkpoint's, or another architecture, is refused in one line naming the difference. The
two-process load is in `test_warm_start_gloo.py`."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ctrflow.checkpoint import load_model, read_meta, resolve_checkpoint
from ctrflow.checkpoint.tables import load_file
from ctrflow.cli import main
from ctrflow.config import ModelConfig, OptimConfig
from ctrflow.errors import UserError
from ctrflow.models import build_model, embedding_collections
from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from ctrflow.lineage import check_descendant
from ctrflow.train.loop import train
from tests.fixtures.tables import read_split
from tests.fixtures.training import write_processed
from tests.fixtures.warm_start import config, make_days

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """The two days and the day-0 checkpoint (`tests.fixtures.warm_start.make_days`)."""
    return make_days(tmp_path_factory.mktemp("warm"))


def table_state(ckpt, table: str, key: str) -> torch.Tensor:
    step_dir = resolve_checkpoint(ckpt)
    return load_file(step_dir / read_meta(step_dir)["files"]["table_state"][table][key])


def old_rows(data, sizes: dict[str, int]):
    """Valid rows of `data` whose ids all lie in the old tables: (dense, sparse) as a batch holds them."""
    table = read_split(data, "valid")
    schema = Schema.load(data)
    dense = torch.tensor([table.column(f.name).to_pylist() for f in schema.features.dense]).T.float()
    columns = []
    for f in schema.features.sparse:
        values = torch.tensor(table.column(f.name).to_pylist())
        columns.append(values.reshape(len(table), -1))
    sparse = torch.cat(columns, dim=1)
    limit = torch.cat([torch.full((f.width,), sizes[f.name]) for f in schema.features.sparse])
    keep = (sparse < limit).all(dim=1)
    return dense[keep], sparse[keep]


def test_vocabulary_grew_between_the_days(days):
    old, new = Schema.load(days["d0"]), Schema.load(days["d1"])
    assert new.cardinalities["userId"] > old.cardinalities["userId"]
    assert new.cardinalities["movieId"] > old.cardinalities["movieId"]


def test_warm_start_scores_old_rows_as_the_checkpoint_before_any_step(days, tmp_path):
    out = tmp_path / "k1"
    train(config(days["d1"], out, init_from=str(days["k0"]), max_steps=0))  # loaded and saved, no step
    before, old_schema, _ = load_model(days["k0"])
    after, new_schema, meta = load_model(out)
    assert meta["step"] == 0 and meta["config"]["init_from"] == str(days["k0"])
    dense, sparse = old_rows(days["d1"], old_schema.cardinalities)
    assert len(dense) > 100
    with torch.no_grad():
        assert torch.equal(after(dense, sparse), before(dense, sparse))  # exactly, on the CPU
    # the output bias is the checkpoint's, not the new data's click rate
    rate = new_schema.label_rate
    assert torch.equal(after.over_arch[-1].bias, before.over_arch[-1].bias)
    assert not math.isclose(after.over_arch[-1].bias.item(), math.log(rate / (1 - rate)), abs_tol=1e-6)
    fresh = build_model("dlrm", new_schema, 16, seed=4, bottom_mlp=(64, 32), top_mlp=(128, 64))
    grown, trained = embedding_collections(after)["embeddings"], embedding_collections(before)["embeddings"]
    drawn = embedding_collections(fresh)["embeddings"].full_weights()
    for name, weight in grown.full_weights().items():
        n = trained.full_weights()[name].shape[0]
        assert torch.equal(weight[:n], trained.full_weights()[name])
        assert torch.equal(weight[n:], drawn[name][n:])  # new rows: a fresh model's of the new size
    for key in ("exp_avg", "exp_avg_sq"):  # Adam's moments of userId's table: old rows kept, new rows zero
        old, new = table_state(days["k0"], "t_userId", key), table_state(out, "t_userId", key)
        assert torch.equal(new[:len(old)], old) and old.abs().sum() > 0
        assert not new[len(old):].any() and len(new) == new_schema.cardinalities["userId"]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


def test_warm_start_trains_on_and_beats_a_cold_start_on_the_next_day(days, tmp_path):
    warm = train(config(days["d1"], tmp_path / "warm", init_from=str(days["k0"]), max_steps=4))
    cold = train(config(days["d1"], tmp_path / "cold", max_steps=4))
    records = [json.loads(line) for line in (tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # a fresh step count and log
    assert warm["valid_auc"] > cold["valid_auc"]


def test_fused_tables_and_another_sparse_optimizer_kind_warm_start(days, tmp_path):
    # the checkpoint stepped its small tables with dense Adam (auto), the fused run uses lazy Adam
    out = tmp_path / "fused"
    summary = train(config(days["d1"], out, init_from=str(days["k0"]), embedding="fused",
                           optim=OptimConfig(lr=0.01, sparse_lr=0.05, sparse="lazy_adam"), max_steps=0))
    assert summary["step"] == 0
    before, old_schema, _ = load_model(days["k0"])
    after, _, _ = load_model(out)
    dense, sparse = old_rows(days["d1"], old_schema.cardinalities)
    with torch.no_grad():
        assert torch.allclose(after(dense, sparse), before(dense, sparse), atol=1e-6)
    assert torch.equal(table_state(out, "t_genres", "exp_avg")[:20], table_state(days["k0"], "t_genres", "exp_avg"))
    with pytest.raises(UserError, match="table t_userId was trained with the adam optimizer, this run uses "
                                        "adagrad .*choose --sparse-optimizer adam"):
        train(config(days["d1"], tmp_path / "x", init_from=str(days["k0"]), max_steps=0,
                     optim=OptimConfig(sparse="adagrad")))


def test_data_that_does_not_descend_from_the_checkpoint_is_refused(days, tmp_path):
    init = str(days["k0"])
    with pytest.raises(UserError, match=r'--init-from .*: feature userId: id \d+ is "\d+" in the checkpoint\'s '
                                        r'vocabulary and "\d+" here'):
        train(config(days["d1_fresh"], tmp_path / "a", init_from=init, max_steps=0))
    trained, data = Schema.load(resolve_checkpoint(init) / "schema.json"), Schema.load(days["d1_fresh"])
    with pytest.raises(UserError, match="do not extend the checkpoint's \\(their first values hash to"):
        check_descendant(trained, data, days["d1_fresh"], "--init-from X")  # the old vocabulary is nowhere
    check_descendant(trained, Schema.load(days["d1"]), days["d1"], "--init-from X")  # proven by hash alone
    small = tmp_path / "small"
    preprocess([str(days["raw"] / "day_1.csv")], [], small, dataset=str(days["raw"] / "movielens.yaml"),
               workers=1, freq_threshold=40)
    with pytest.raises(UserError, match="smaller than the checkpoint's \\(feature userId: \\d+ values in the "
                                        "checkpoint's vocabulary, \\d+ here\\)"):
        check_descendant(trained, Schema.load(small), small, "--init-from X")
    other = dataclasses.replace(data, features=dataclasses.replace(data.features, sparse=data.features.sparse[:2]))
    with pytest.raises(UserError, match="trained on other features: sparse features differ: only in the checkpoint "
                                        "genres; only here none"):
        check_descendant(trained, other, days["d1"], "--init-from X")


def test_another_architecture_or_no_checkpoint_is_one_line(days, tmp_path, capsys):
    with pytest.raises(UserError, match="the checkpoint's model differs from this run's: embedding_dim 16 != 8"):
        train(config(days["d1"], tmp_path / "a", init_from=str(days["k0"]), max_steps=0,
                     model=ModelConfig(name="dlrm", embedding_dim=8)))
    code = main(["train", "--data", str(days["d1"]), "--out", str(tmp_path / "b"), "--init-from",
                 str(tmp_path), "--max-steps", "0", "--no-progress", "--tracking-uri", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--init-from" in err and "not a ctrflow checkpoint" in err


def test_init_from_is_a_config_field_and_a_flag(tmp_path, capsys):
    assert main(["train", "--data", "d", "--out", "o", "--init-from", "ckpt", "--print-config"]) == 0
    assert "init_from: ckpt" in capsys.readouterr().out


def test_checkpoint_of_another_dataset_description_is_one_line_naming_the_difference(days, tmp_path, capsys):
    # the same day described with mean-pooled genres of 3 at most: another model input, refused before training
    description = days["raw"] / "movielens.yaml"
    other = tmp_path / "mean.yaml"
    other.write_text(description.read_text().replace("max_length: 4, pooling: sum", "max_length: 3, pooling: mean"))
    data = tmp_path / "d1_mean"
    preprocess([str(days["raw"] / "day_1.csv")], [str(days["raw"] / "day_0.csv")], data, dataset=str(other),
               workers=1)
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "a"), "--init-from", str(days["k0"]),
                 "--model", "dlrm", "--embedding-dim", "16", "--batch-size", "512", "--max-steps", "0", "--no-progress",
                 "--tracking-uri", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--init-from" in err and "genres max_length 4 != 3" in err and "genres pooling sum != mean" in err
    # Criteo's columns: none of the checkpoint's features, each side named
    criteo = write_processed(tmp_path / "criteo", train_rows=600, valid_rows=64, parts=1)
    code = main(["train", "--data", str(criteo), "--out", str(tmp_path / "b"), "--init-from", str(days["k0"]),
                 "--model", "dlrm", "--embedding-dim", "16", "--batch-size", "512", "--max-steps", "0", "--no-progress",
                 "--tracking-uri", "none"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert ("the checkpoint was trained on other features: dense features differ: only in the checkpoint age, price; "
            "only here I1, I2, I3, I4 (+9 more)") in err
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("*.safetensors"))
