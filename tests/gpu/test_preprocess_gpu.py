"""The gpu engine on a CUDA GPU gives exactly the CPU engine's output and bad-row accounting."""

from __future__ import annotations


import pytest
import torch

from ctrflow.ingest.run import preprocess

from tests.fixtures.preprocess import random_rows, row, write
from tests.fixtures.preprocess import assert_same_dataset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("on_bad_rows", ["error", "skip"])
def test_gpu_cuda_engine_output_and_bad_rows_are_identical_to_cpu(tmp_path, on_bad_rows):
    lines = random_rows(4000, seed=6) + [row("1", {"I5": "123456789012", "I2": "-7"})] * 3
    if on_bad_rows == "skip":
        lines[10], lines[2500] = row("2"), lines[2500] + "\tx"
    src = write(tmp_path / "in.tsv", lines)
    outs = {}
    for engine, device in (("cpu", "cpu"), ("gpu", "cuda")):
        outs[engine] = tmp_path / engine
        preprocess([src], out=outs[engine], freq_threshold=2, valid_fraction=0.2, workers=2, chunk_rows=600,
                   engine=engine, device=device, seed=3, on_bad_rows=on_bad_rows)
    assert_same_dataset(outs["gpu"], outs["cpu"])
    if on_bad_rows == "skip":
        assert (outs["gpu"] / "rejected.tsv").read_text() == (outs["cpu"] / "rejected.tsv").read_text()
