"""Issue 2's quality bar, end to end: synth -> preprocess -> one epoch of DLRM on 200,000 rows."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ctrflow.config import small_config
from ctrflow.preprocess.run import preprocess
from ctrflow.datasets.criteo.synth import synthesize
from ctrflow.train.loop import train

pytestmark = pytest.mark.integration


def test_one_epoch_of_dlrm_reaches_most_of_the_teacher_auc(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fastest setting on a busy 2-core machine
    try:
        info = synthesize(tmp_path / "raw", rows=200_000, days=2, seed=0)
        preprocess([str(tmp_path / "raw" / "day_0.tsv")], [str(tmp_path / "raw" / "day_1.tsv")],
                   tmp_path / "data", progress=False)
        config = dataclasses.replace(small_config(str(tmp_path / "data"), str(tmp_path / "ckpt")), progress=False)
        summary = train(config)
    finally:
        torch.set_num_threads(threads)
    teacher = info["teacher_auc"]["day_1"]
    assert summary["valid_rows"] == 200_000 and summary["epoch"] == 1
    assert summary["valid_auc"] - 0.5 >= 0.7 * (teacher - 0.5), (summary["valid_auc"], teacher)
    last = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["auc"] == pytest.approx(summary["valid_auc"])
