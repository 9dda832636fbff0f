"""Scoring a model on rows processed with a vocabulary that grew after it was trained (the champion
in `ctrflow promote`'s gate): the same AUC as those rows read through the model's own vocabulary,
and a model the data does not descend from is refused in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ctrflow.checkpoint import load_model
from ctrflow.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.synth.movielens import synthesize
from ctrflow.errors import UserError
from ctrflow.evaluate import evaluate
from ctrflow.evaluate.holdout import read_as_trained, score_holdout
from ctrflow.contract.features import Feature, Features
from ctrflow.ingest.run import preprocess
from ctrflow.contract.schema import Schema
from ctrflow.serve.ranking import save_ranking_model
from ctrflow.train.loop import train


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Three drifting movielens-like days; d0: train day 0, d1: train day 1 grown from d0; both hold
    day 2 out (the same rows, through each one's vocabulary); k0 trained on d0, k1 warm-started on d1."""
    root = tmp_path_factory.mktemp("holdout")
    synthesize(root / "raw", rows=3000, days=3, seed=7, drift=0.2)
    description = str(root / "raw" / "movielens.yaml")
    day = [str(root / "raw" / f"day_{k}.csv") for k in range(3)]
    preprocess([day[0]], [day[2]], root / "d0", dataset=description, workers=1)
    preprocess([day[1]], [day[2]], root / "d1", dataset=description, workers=1, vocab_from=root / "d0")
    base = TrainConfig(out=str(root / "k0"), data=DataConfig(path=str(root / "d0"), batch_size=256, prefetch=2),
                       model=ModelConfig(name="dlrm", embedding_dim=8), optim=OptimConfig(lr=0.01, sparse_lr=0.05),
                       progress=False, threads=1, seed=3, max_steps=20)
    train(base)
    train(dataclasses.replace(base, out=str(root / "k1"), data=dataclasses.replace(base.data, path=str(root / "d1")),
                              init_from=str(root / "k0"), max_steps=5))
    for name in ("k0", "k1"):
        model, schema, meta = load_model(root / name)
        save_ranking_model(model, schema, meta, root / f"{name}_ranking")
    return root


def test_an_older_model_scores_grown_rows_as_its_own_vocabulary_reads_them(days):
    old, grown = Schema.load(days / "d0"), Schema.load(days / "d1")
    assert grown.cardinalities["movieId"] > old.cardinalities["movieId"]  # day 1 brought new movies
    own = evaluate(days / "d0", days / "k0", days / "eval_k0")

    scored = score_holdout(days / "k0_ranking", days / "d1", "valid", "champion")

    assert scored.rows == own["rows"] == 3000
    assert scored.auc == pytest.approx(own["auc"], abs=1e-7)


def test_ids_the_model_never_had_read_as_unseen_and_padding_stays():
    features = Features(dense=(), sparse=(Feature("a", "categorical", cardinality=5),
                                          Feature("b", "multi_hot", cardinality=4, max_length=3, pooling="sum")))
    grown = np.array([[4, 3, 4, 0], [7, 2, 9, 1]], dtype=np.int32)

    assert read_as_trained(grown, features).tolist() == [[4, 3, 1, 0], [1, 2, 1, 1]]
    assert grown.tolist() == [[4, 3, 4, 0], [7, 2, 9, 1]]  # the rows themselves are left alone


def test_a_model_of_a_newer_vocabulary_cannot_score_older_rows(days):
    with pytest.raises(UserError) as refused:
        score_holdout(days / "k1_ranking", days / "d0", "valid", "candidate version 2 cannot score d0/valid")

    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("candidate version 2 cannot score d0/valid: this data's vocabulary is smaller")
