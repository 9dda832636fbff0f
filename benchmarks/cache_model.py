"""The rows a training step must move for tables in host memory: an LRU cache over batches (the plain path's
`HostCache`) against the best any cache could do, from the ids' distribution alone. The fused path's
frequency cache comes within 7 % of the best at the DLRMv2 shape (`benchmarks/NOTES.md`).

    PYTHONPATH=src python3 benchmarks/cache_model.py                  # DLRMv2 shape, 32 GiB budget
    PYTHONPATH=src python3 benchmarks/cache_model.py --rows-per-s 28.7e6

The host tables and cache sizes are those `benchmarks/host_tier.py` runs (`ctrflow.embedding.placement`),
its ids log-uniform over each table's rows (id k drawn with probability ln(1 + 1/k) / ln N), every draw
independent. A batch draws row k about lambda_k = ids a step x p_k times. An LRU cache over batches holds a
row while it was looked up within the last T batches, so (Che's approximation) it is cached with
probability 1 - exp(-lambda_k T), T chosen so these fill the cache, and a step misses sum_k (1 - exp(-lambda_k))
exp(-lambda_k T) rows. For independent draws no cache beats holding the C most likely rows: it misses the
lookups of the others, sum_{k > C} (1 - exp(-lambda_k)) rows a step. Every miss is read in and, in the steady
state, evicts a row a training batch changed, written back. `--rows-per-s` (a measured rate of random rows
each way, from `host_tier.py`'s `pcie_gb_per_s`) turns the rows into milliseconds a step. Prints one JSON
line. Imports numpy, torch and ctrflow.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from host_tier import GIB, host_rows, shape_tables  # noqa: E402


def log_uniform(rows: int, exact: int = 100_000, width: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """(p, n): n rows of probability p each, most likely first, for ids k = 1..rows - 1 drawn as
    `host_tier.draw_ids` draws them, P(k) = ln(1 + 1/k) / ln rows: ids below `exact` one by one, the rest in
    runs of ids whose probabilities differ by about `width` (their mean), so a 40 M-row table is ~200 k runs."""
    edges = np.unique(np.concatenate([np.arange(1, min(exact, rows)),
                                      np.geomspace(min(exact, rows), rows, int(np.log(rows / exact) / width) + 2)
                                      if rows > exact else [rows]]).round())
    n = np.diff(edges)
    p = np.log(edges[1:] / edges[:-1]) / np.log(rows) / n  # the run's mass, shared by its rows
    return p, n


def misses(p: np.ndarray, n: np.ndarray, draws: float, cache_rows: int) -> dict:
    """Distinct rows a step looks up, and the rows it misses under LRU over batches and under the best cache
    of `cache_rows` rows, for `draws` independent ids a step, n rows of probability p each, most likely
    first (the module doc)."""
    rate = draws * p
    looked_up = -np.expm1(-rate)
    if cache_rows >= n.sum():
        return {"distinct": float(n @ looked_up), "lru": 0.0, "best": 0.0, "lru_window_batches": None}
    low, high = 1e-3, 1e9  # the window T: rows looked up within T batches fill the cache
    for _ in range(60):
        window = (low * high) ** 0.5
        low, high = (low, window) if n @ -np.expm1(-rate * window) > cache_rows else (window, high)
    cached = np.clip(cache_rows - (np.cumsum(n) - n), 0, n)  # the best cache: the most likely rows
    return {"distinct": float(n @ looked_up), "lru": float(n @ (looked_up * np.exp(-rate * window))),
            "best": float((n - cached) @ looked_up), "lru_window_batches": float(window)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gib", type=float, default=32.0)
    p.add_argument("--batch", type=int, default=55296)
    p.add_argument("--row-cap", type=int, default=0, help="cap every table's rows (0: MLPerf's sizes)")
    p.add_argument("--rows-per-s", type=float, default=0.0,
                   help="random rows a second moved each way (0: no times)")
    args = p.parse_args(argv)
    args.shape, args.dim = "dlrmv2", 128  # what `host_tier.shape_tables` reads
    return args


def main(argv: list[str] | None = None) -> dict:
    """Model every host table of `host_tier.py`'s placement; print and return the JSON record."""
    args = parse(argv)
    tables = {t.name: t for t in shape_tables(args)}
    per_table = {}
    for name, cache_rows in host_rows(list(tables.values()), args, int(args.budget_gib * GIB)).items():
        t = tables[name]
        per_table[name] = {"rows": t.num_embeddings, "ids_per_sample": t.length, "cache_rows": cache_rows,
                           **misses(*log_uniform(t.num_embeddings), args.batch * t.length, cache_rows)}
    total = {key: sum(r[key] for r in per_table.values()) for key in ("distinct", "lru", "best")}
    row_bytes = args.dim * 4 + 4  # fp32 row and its row-wise Adagrad sum
    record = {"benchmark": "cache_model", "shape": "dlrmv2", "batch": args.batch, "budget_gib": args.budget_gib,
              "tables": per_table, "distinct_rows_per_step": total["distinct"],
              "missed_rows_per_step": {"lru": total["lru"], "best": total["best"]},
              "hit_rate": {k: 1 - total[k] / total["distinct"] for k in ("lru", "best")},
              "gb_per_step_each_way": {k: total[k] * row_bytes / 1e9 for k in ("lru", "best")}}
    if args.rows_per_s:  # read in, then as many written back
        record["moves_ms"] = {k: 2 * total[k] / args.rows_per_s * 1e3 for k in ("lru", "best")}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
