"""Preprocessing's accounting: every input row is read = written + rejected, per file.

Blocks come back in input order, so block-relative line numbers become file line numbers here,
bad rows stop the run (one line: file, line, problem) or go to `rejected.tsv`; at the end the
totals, per-column missing rates and cardinalities and the time of each pass go to `stats.json`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ctrflow.preprocess.files import truncation_message
from ctrflow.schema import FIRST_ID, Schema
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.preprocess.vocab import vocab_hash
from ctrflow.errors import UserError


def file_stats(path: Path, split: str) -> dict:
    """A file's entry in stats.json, before any row is counted."""
    return {"path": str(path), "split": "train+valid" if split == "split" else split,
            "bytes": path.stat().st_size, "rows_read": 0, "rows_written": 0, "rows_rejected": 0}


def account_block(result: dict, files, per_file: list[dict], rejected, warnings: list[str]) -> None:
    """Turn block-relative lines into file lines (blocks arrive in order); stop or log bad rows."""
    index = result["file"]
    path, stats = files[index][0], per_file[index]
    base = stats["rows_read"]
    if result["truncated"]:
        tail = result["tail"]
        if rejected is None:
            raise UserError(truncation_message(path, base + (1 if tail else 0), tail))
        if tail:
            result["problems"] = [(0, "truncated gzip file: incomplete last line", tail)]
        else:
            warnings.append(truncation_message(path, base, tail))
    for line, reason, raw in result["problems"]:
        if rejected is None:
            raise UserError(f"{path}: line {base + line + 1}: {reason}")
        text = raw.decode("utf-8", "replace").rstrip("\r")
        rejected.write(f"{path}\t{base + line + 1}\t{reason}\t{text}\n")
    stats["rows_read"] += result["lines"]
    stats["rows_written"] += result["rows"]["train"] + result["rows"]["valid"]
    stats["rows_rejected"] += len(result["problems"])


def collect_stats(records, per_file, distinct: dict[str, int], tables, rows, warnings, passes, workers,
                  chunk_rows) -> dict:
    """stats.json's content (plus the cardinalities and vocab hash that go to schema.json)."""
    written = rows["train"] + rows["valid"]
    missing = sum((r["missing"] for r in records), np.zeros(len(DENSE) + len(SPARSE), dtype=np.int64))
    columns = {name: {"missing_rate": round(float(missing[j]) / max(1, written), 6)} for j, name in enumerate(DENSE)}
    for j, name in enumerate(SPARSE):
        columns[name] = {"missing_rate": round(float(missing[len(DENSE) + j]) / max(1, written), 6),
                         "cardinality": len(tables[name]) + FIRST_ID, "distinct_train": distinct[name]}
    total = sum(passes.values())
    return {
        "rows_read": sum(f["rows_read"] for f in per_file),
        "rows_written": sum(f["rows_written"] for f in per_file),
        "rows_rejected": sum(f["rows_rejected"] for f in per_file),
        "rows": rows, "files": per_file, "columns": columns, "passes": passes,
        "rows_per_second": round(sum(f["rows_read"] for f in per_file) / total, 1) if total else None,
        "workers": workers, "chunk_rows": chunk_rows, "warnings": warnings,
        "cardinalities": {name: len(tables[name]) + FIRST_ID for name in SPARSE},
        "vocab_hash": vocab_hash({name: tables[name].column("value") for name in SPARSE}),
    }


def summarize(out: Path, schema: Schema, stats: dict, workers: int) -> dict:
    """What `preprocess` returns."""
    return {"out": str(out), "rows": schema.rows, "rows_read": stats["rows_read"],
            "rows_written": stats["rows_written"], "rows_rejected": stats["rows_rejected"],
            "cardinalities": schema.cardinalities, "vocab_hash": schema.vocab_hash,
            "seconds": stats["passes"]["total_seconds"], "workers": workers}


def track(tracker, summary: dict, stats: dict, out: Path, params: dict) -> None:
    """Log params, row counts, cardinalities, pass times and the schema/stats files to the tracker."""
    tracker.log_params(params)
    metrics = {"rows_train": summary["rows"]["train"], "rows_valid": summary["rows"]["valid"],
               "rows_read": summary["rows_read"], "rows_rejected": summary["rows_rejected"],
               "seconds": summary["seconds"], **{k: v for k, v in stats["passes"].items()},
               **{f"cardinality_{k}": v for k, v in summary["cardinalities"].items()}}
    if stats.get("rows_per_second"):
        metrics["rows_per_second"] = stats["rows_per_second"]
    tracker.log_metrics(metrics)
    tracker.set_tags({"vocab_hash": summary["vocab_hash"]})
    for name in ("schema.json", "stats.json"):
        tracker.log_artifact(out / name, "preprocess")
