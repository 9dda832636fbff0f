"""Adding a model as `docs/adding-a-model.md` says: one new file that declares the model and its own
setting and registers them, and one registration line (importing the file). The new model then trains
through `ctrflow train`'s real entry point with its own flag, shows in `--print-config`, and rebuilds
from its checkpoint."""

from __future__ import annotations

import importlib.util

import pytest

from ctrflow.cli import main
from ctrflow.checkpoint import load_model
from ctrflow.models import spec
from tests.fixtures.training import write_processed

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

# the one new file: a linear model over the flattened embeddings with a hidden layer of its own width
TOY_MODEL = '''
"""A toy model: the flattened embeddings and the dense features through one hidden layer."""

from dataclasses import dataclass, field

import torch

from ctrflow.models.base import RankingModel
from ctrflow.models.layers import MLP
from ctrflow.models.spec import register


@dataclass(frozen=True)
class ToyConfig:
    """The toy model's own setting."""

    hidden_width: int = field(default=8, metadata={"help": "width of the one hidden layer"})


class Toy(RankingModel):
    """[dense, embeddings flattened] -> hidden layer -> logit."""

    def __init__(self, features, embedding_dim, settings, seed=0, dropout=0.0, embedding_init_scale=0.1):
        super().__init__(features, embedding_dim, seed, embedding_init_scale)
        width = features.num_dense + len(features.sparse) * embedding_dim
        self.over_arch = MLP(width, [settings.hidden_width, 1], last_activation=False, dropout=dropout)

    def head(self, dense, embedded):
        return self.over_arch(torch.cat([dense, embedded.flatten(1)], dim=1)).squeeze(1)


register("toy", Toy, ToyConfig)
'''


@pytest.fixture
def toy_model(tmp_path):
    """The toy model's file written and imported (its registration line), registered for this test only."""
    path = tmp_path / "toy_model.py"
    path.write_text(TOY_MODEL)
    module_spec = importlib.util.spec_from_file_location("toy_model", path)
    module_spec.loader.exec_module(importlib.util.module_from_spec(module_spec))
    yield "toy"
    del spec.MODELS["toy"]


def test_a_new_model_with_a_setting_of_its_own_trains_through_ctrflow_train(toy_model, tmp_path, capsys):
    data = write_processed(tmp_path / "data", train_rows=1024, valid_rows=256, cardinality=20)
    assert main(["train", "--model", "toy", "--hidden-width", "5", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "name: toy" in printed and "hidden_width: 5" in printed and "top_mlp" not in printed
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "toy: width of the one hidden layer" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")
    out = tmp_path / "ckpt"
    assert main(["train", "--data", str(data), "--out", str(out), "--model", "toy", "--hidden-width", "5",
                 "--batch-size", "256", "--max-steps", "4", "--no-progress", "--tracking-uri", "none"]) == 0
    model, _schema, meta = load_model(out)
    assert meta["model"]["name"] == "toy" and meta["model"]["arch"] == {"hidden_width": 5, "dropout": 0.0}
    assert model.over_arch[0].out_features == 5  # rebuilt by name, with its own setting
    assert main(["train", "--config", str(out / "config.json"), "--print-config"]) == 0
    assert "hidden_width: 5" in capsys.readouterr().out
