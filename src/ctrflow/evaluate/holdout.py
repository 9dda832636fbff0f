"""A model scored on held-out rows processed with a vocabulary that grew after it was trained.

The gate of `ctrflow promote` scores yesterday's champion and today's candidate on the same rows:
today's held-out split, whose ids come from today's vocabularies. `ctrflow preprocess --vocab-from`
keeps every old value's id and puts new values after them, so an id at or above a model's table
size is a value that model never had a row for: to that model it is unseen, id 1 (OOV). Reading
those ids as 1 gives exactly the ids the model's own vocabulary would have given the same raw rows,
so both models are scored on the same rows as each would see them when served.

A model whose vocabularies the data does not extend (other features, another dataset, a vocabulary
made afresh, or a newer vocabulary than the data's) cannot score the rows: a one-line UserError
names the first difference (`ctrflow.lineage.check_descendant`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ctrflow.contract.features import OOV_ID, Features
from ctrflow.contract.schema import Schema
from ctrflow.lineage import check_descendant
from ctrflow.metrics import auc


@dataclass(frozen=True)
class HoldoutScore:
    """AUC of one model on a split's rows."""

    auc: float
    rows: int


def read_as_trained(sparse: np.ndarray, trained: Features) -> np.ndarray:
    """sparse [N, slots] ids of a descendant vocabulary -> the ids the `trained` tables know: every
    id at or above its feature's table size becomes OOV_ID (padding 0 stays 0). A copy."""
    out = np.array(sparse, copy=True)
    start = 0
    for feature in trained.sparse:
        block = out[:, start:start + feature.width]
        block[block >= feature.cardinality] = OOV_ID
        start += feature.width
    return out


def score_holdout(ranking_dir: str | os.PathLike, data: str | os.PathLike, split: str, where: str) -> HoldoutScore:
    """AUC of the ranking model saved in `ranking_dir` (`ctrflow.serve.ranking.save_ranking_model`) on
    `data/split`; `where` prefixes the one-line error when the model cannot score that data."""
    from ctrflow.loaders.memory import ParquetDataset
    from ctrflow.predict import score_logits
    from ctrflow.serve.ranking import load_ranking_model

    trained, holdout = Schema.load(ranking_dir), Schema.load(data)
    check_descendant(trained, holdout, data, where)
    ranking = load_ranking_model(ranking_dir)
    rows = ParquetDataset(Path(data), split, holdout.table_sizes())
    logits = score_logits(ranking.model, rows.dense, read_as_trained(rows.sparse, trained.features))
    return HoldoutScore(auc=float(auc(rows.labels, logits)), rows=len(rows))
