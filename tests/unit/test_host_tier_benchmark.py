"""benchmarks/host_tier.py --small on the CPU (the GPU run uses the same code)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_tier.py"
pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)


@pytest.mark.parametrize("path", ["fused", "plain"])
def test_small_run_prints_one_json_line_comparing_cached_and_device_tables(capsys, path):
    record = runpy.run_path(str(SCRIPT))["main"](["--small", "--path", path])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == record
    assert record["tables"] == 26 and record["ids_per_sample"] == 214 and record["gpu"] == "cpu"
    assert record["device_samples_per_s"] > 0 and record["cached_samples_per_s"] > 0
    assert record["ratio"] == record["cached_samples_per_s"] / record["device_samples_per_s"]
    assert record["host_tables"] > 0 and 0.0 < record["cache_hit_rate"] < 1.0  # Zipf ids: hot rows hit
    assert record["budget_gib"] < record["table_gib"] and record["host_gib"] > 0
    assert record["path"] == path and record["step_ms"]["cached"] > 0


def test_the_one_hot_dim_256_shape_reports_its_cached_side(capsys):
    record = runpy.run_path(str(SCRIPT))["main"](["--small", "--shape", "onehot-dim256"])
    assert record["ids_per_sample"] == 26 and record["host_tables"] > 0 and record["cached_samples_per_s"] > 0


@pytest.mark.parametrize("shape", ["dlrmv2", "onehot-dim256"])
def test_the_whole_training_step_compares_cached_and_device_tables(capsys, shape):
    record = runpy.run_path(str(SCRIPT))["main"](["--small", "--shape", shape, "--dense", "bf16"])
    assert record["step"] == "whole, dense in bf16" and record["host_tables"] > 0
    assert record["device_samples_per_s"] > 0 and record["cached_samples_per_s"] > 0
    # timed once every cache is full: each row read in evicts one, written back (a training batch changed it)
    assert record["gb_per_step"]["read"] > 0 and record["gb_per_step"]["written"] > 0
