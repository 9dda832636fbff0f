"""`ctrflow train --embedding-memory-gib`: tables beyond the budget in host memory with a device cache
train bitwise like all on the device (weights, optimizer state, validation through the cache), the
run records each table's placement, and checkpoints cross between the two placements."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from ctrflow.cli import main
from tests.fixtures.training import write_processed

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)
BUDGET = ["--embedding-memory-gib", "0.004"]  # of ~15 MiB of tables with lazy Adam state


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_processed(tmp_path_factory.mktemp("processed"), train_rows=64 * 60, valid_rows=512,
                           cardinality=3000)


def _train(data_dir, out, steps, *extra):
    assert main(["train", "--data", str(data_dir), "--out", str(out), "--batch-size", "64", "--eval-batch-size",
                 "128", "--max-steps", str(steps), "--seed", "5", "--log-every", "1", "--no-progress",
                 "--tracking-uri", "none", *extra]) == 0
    return out


def _step_files(out):
    step = out / (out / "latest").read_text().strip()
    meta = json.loads((step / "meta.json").read_text())
    names = [n for n in meta["sha256"] if n.endswith(".pt") and n != "rng.pt"]
    return {n: torch.load(step / n, weights_only=True) for n in names}


def _assert_same_checkpoint(a, b):
    files_a, files_b = _step_files(a), _step_files(b)
    assert sorted(files_a) == sorted(files_b)
    assert any(n.startswith("table_state/") for n in files_a)
    for name in files_a:
        if name.startswith(("tables/", "table_state/")):
            assert torch.equal(files_a[name], files_b[name]), name
    for key, value in files_a["dense.pt"].items():
        assert torch.equal(value, files_b["dense.pt"][key]), key


def test_a_cached_run_trains_and_validates_bitwise_like_one_on_the_device(data_dir, tmp_path, capsys):
    device = _train(data_dir, tmp_path / "device", 50)
    cached = _train(data_dir, tmp_path / "cached", 50, *BUDGET)
    printed = capsys.readouterr().out
    assert "host, cache" in printed
    _assert_same_checkpoint(device, cached)
    summaries = [json.loads((out / "train_summary.json").read_text()) for out in (device, cached)]
    assert summaries[0]["valid_auc"] == summaries[1]["valid_auc"]
    assert "cache_hit_rate" not in summaries[0] and 0 < summaries[1]["cache_hit_rate"] < 1
    plan = json.loads((cached / "config.json").read_text())["plan"]
    assert plan["placement"].startswith("device ") and ", host " in plan["placement"]
    shards = [s for entry in plan["sharding_plan"]["tables"].values() for s in entry["shards"]]
    host = [s for s in shards if s["placement"] == "host"]
    assert host and all(256 <= s["cache_rows"] < 3000 for s in host)  # two eval batches' ids at least


def test_checkpoints_cross_between_cached_and_device_runs(data_dir, tmp_path):
    device = _train(data_dir, tmp_path / "device", 20)
    cached = _train(data_dir, tmp_path / "cached", 20, *BUDGET)
    for src, dst in ((device, "on_cached"), (cached, "on_device")):
        shutil.copytree(src, tmp_path / dst)
    on_cached = _train(data_dir, tmp_path / "on_cached", 30, "--resume", str(tmp_path / "on_cached"), *BUDGET)
    on_device = _train(data_dir, tmp_path / "on_device", 30, "--resume", str(tmp_path / "on_device"))
    _assert_same_checkpoint(on_cached, on_device)


def test_print_config_shows_each_tables_placement_as_comments(data_dir, capsys):
    assert main(["train", "--data", str(data_dir), "--batch-size", "64", "--eval-batch-size", "128",
                 "--print-config", *BUDGET]) == 0
    printed = capsys.readouterr().out
    assert yaml.safe_load(printed)["embedding_memory_gib"] == 0.004  # still a config file
    rows = [line for line in printed.splitlines() if line.startswith("# t_C")]
    assert len(rows) == 26 and any("host, cache" in r for r in rows) and any(r.endswith("device") for r in rows)


def test_fused_tables_in_host_memory_train_bitwise_like_fused_tables_on_the_device(data_dir, tmp_path):
    device = _train(data_dir, tmp_path / "device", 50, "--embedding", "fused")
    cached = _train(data_dir, tmp_path / "cached", 50, "--embedding", "fused", *BUDGET)
    plan = json.loads((cached / "config.json").read_text())["plan"]
    assert plan["embedding"] == "fused" and ", host " in plan["placement"]
    _assert_same_checkpoint(device, cached)
    summaries = [json.loads((out / "train_summary.json").read_text()) for out in (device, cached)]
    assert summaries[0]["valid_auc"] == summaries[1]["valid_auc"]
    assert 0 < summaries[1]["cache_hit_rate"] < 1
    resumed = _train(data_dir, tmp_path / "device", 60, "--embedding", "fused", "--resume", str(device), *BUDGET)
    assert json.loads((resumed / "train_summary.json").read_text())["step"] == 60


def test_evaluate_within_a_budget_scores_through_the_cache_like_all_on_the_device(data_dir, tmp_path, capsys):
    """`ctrflow evaluate --embedding-memory-gib`: the tables beyond it read through a device cache, the
    metrics those of every table on the device, to the last digit."""
    ckpt = _train(data_dir, tmp_path / "ckpt", 20)
    metrics = {}
    for name, extra in (("device", []), ("cached", ["--embedding-memory-gib", "0.002"])):
        assert main(["evaluate", "--data", str(data_dir), "--checkpoint", str(ckpt), "--out", str(tmp_path / name),
                     "--batch-size", "128", "--device", "cpu", "--tracking-uri", "none", *extra]) == 0
        metrics[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert ", host " in metrics["cached"].pop("embedding_placement")
    for key in ("auc", "logloss", "rows", "mean_prediction", "ece"):
        assert metrics["cached"][key] == metrics["device"][key], key
