"""benchmarks/embedding_bag.py on the CPU with tiny tables (the GPU run uses the same code)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "embedding_bag.py"


def test_smoke_run_prints_one_json_line_timing_both_sides(capsys):
    spec = importlib.util.spec_from_file_location("embedding_bag", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    record = bench.main(["--smoke"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == record
    assert record["ids_per_sample"] == 214 and record["tables"] == 26
    for optimizer in ("sgd", "adam"):
        result = record[optimizer]
        assert result["fused_step_ms"] > 0 and result["torch_step_ms"] > 0
        assert result["ratio"] == result["torch_step_ms"] / result["fused_step_ms"]
    assert record["sgd"]["forward_max_rel_err"] < 1e-5  # both sides looked up the same bags from the same weights
