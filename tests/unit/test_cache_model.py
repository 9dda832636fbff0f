"""benchmarks/cache_model.py's prediction of the rows an LRU cache reads in, against ctrflow's fused host cache
run on the CPU with the same ids."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import torch

from ctrflow.embedding.fused.cache import SlotCache

MODEL = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "cache_model.py"))


def test_the_lru_model_predicts_the_rows_the_fused_cache_reads_in_a_step():
    rows, draws, cache_rows = 200_000, 4096, 20_000
    parts = [torch.zeros(cache_rows, 2)]
    cache = SlotCache(rows, 0, cache_rows, padding=False, parts=parts)
    gen = torch.Generator().manual_seed(0)
    read = []
    for _ in range(160):  # log-uniform ids as host_tier.py draws them
        ids = torch.exp(torch.rand(draws, generator=gen, dtype=torch.float64) * math.log(rows)).long()
        before = int(cache.stats[2])
        cache.place(ids.clamp(1, rows - 1), parts, train=True)
        read.append(int(cache.stats[2]) - before)
    assert not bool((cache.id_of[:cache_rows] < 0).any())  # full: the steady state
    predicted = MODEL["misses"](*MODEL["log_uniform"](rows), draws, cache_rows)
    measured = sum(read[-60:]) / 60
    assert abs(measured - predicted["lru"]) < 0.05 * predicted["lru"], (measured, predicted)
    assert predicted["best"] < 0.9 * predicted["lru"]  # a frequency cache would read fewer
