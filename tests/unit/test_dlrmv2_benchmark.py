"""benchmarks/dlrmv2.py on the CPU with tiny tables (the GPU runs use the same code)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dlrmv2.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dlrmv2_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shape_is_mlperf_dlrmv2s(bench):
    features = bench.dlrmv2_features(bench.ROWS, bench.HOTNESS)
    assert features.num_dense == 13 and len(features.sparse) == 26 and features.slots == 214
    assert sum(bench.ROWS) == 204_184_588
    tables = bench.dlrmv2_tables(bench.ROWS, bench.HOTNESS, 128)
    assert [t.pooling for t in tables].count("sum") == 15 and sum(t.bytes for t in tables) / 2**30 > 97


def test_batches_hold_every_id_inside_its_table_and_no_padding_in_bags(bench):
    rows = [min(n, 500) for n in bench.ROWS]
    (dense, ids, labels), = bench.make_batches(rows, bench.HOTNESS, 300, 1, torch.device("cpu"), seed=1)
    owner = [t for t, k in enumerate(bench.HOTNESS) for _ in range(k)]
    sizes = torch.tensor([rows[t] for t in owner])
    assert ids.shape == (300, 214) and dense.shape == (300, 13) and bool((ids >= 0).all() & (ids < sizes).all())
    in_bags = torch.tensor([bench.HOTNESS[t] > 1 for t in owner])
    assert bool((ids[:, in_bags] > 0).all())  # a ctrflow bag reads id 0 as padding; MLPerf's bags are full
    assert 0.2 < float(labels.mean()) < 0.8 and torch.isfinite(dense).all()


def test_benchmark_prints_one_json_line_with_each_path_and_the_ratio(bench, capsys):
    record = bench.main(["--small", "--paths", "naive,fast-eager,tables", "--quality-steps", "2",
                         "--quality-seeds", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["best_path"] == "fast-eager"
    assert record["batch"] == 128 and record["world_size"] == 1 and record["ids_per_sample"] == 214
    for name in ("naive", "fast-eager", "tables"):
        assert record[name]["samples_per_s"] > 0 and math.isfinite(record[name]["final_loss"])
    assert record["ratio"] == record["fast-eager"]["samples_per_s"] / record["naive"]["samples_per_s"]
    # fp32 on the CPU: the fused path is the plain path's arithmetic, from the same tables
    assert abs(record["auc_diff_fast"]) < 1e-3 and 0 < record["auc_plain"] < 1


def test_unknown_paths_are_refused(bench):
    with pytest.raises(ValueError, match="unknown path"):
        bench.split_path("fast:fp9")
