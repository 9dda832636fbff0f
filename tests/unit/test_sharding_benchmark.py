"""benchmarks/sharded_scale.py on the CPU with tiny tables (the GPU runs use the same code)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sharded_scale.py"
TINY = ["--device", "cpu", "--rows-scale", "1e-5", "--dim", "8", "--batch-size", "32", "--steps", "2", "--warmup", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sharded_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_prints_one_json_line_with_plan_memory_and_speed(bench, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    bench.main(TINY)
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert len(lines) == 1 and record["fits"] is True and record["world_size"] == 1
    assert len(record["plan"]) == 26 and record["samples_per_s"] > 0
    assert len(record["memory_gib_per_process"]) == 1 and record["rows"] == sum(
        max(1, int(n * 1e-5)) for n in bench.MLPERF_TABLES)


def test_benchmark_reports_a_model_too_big_for_the_memory(bench, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    record = bench.main([*TINY, "--rows-scale", "1e-3", "--memory-budget-gib", "0.001"])
    assert record["fits"] is False and "does not fit: rank 0" in record["error"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fits"] is False


def test_benchmark_runs_the_fused_sharded_path(bench, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    record = bench.main([*TINY, "--dim", "16", "--embedding", "fused", "--rows-scale", "1e-4"])
    assert record["embedding"] == "fused" and record["fits"] is True and record["samples_per_s"] > 0
    assert record["large"] == "table" and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fits"]
