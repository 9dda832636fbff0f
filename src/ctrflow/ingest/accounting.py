"""Preprocessing's accounting: every input row is read = written + rejected, per file.

Blocks come back in input order, so block-relative line numbers become file line numbers here,
bad rows stop the run (one line: file, line, problem) or go to `rejected.tsv`; at the end the
totals, per-column missing rates and cardinalities and the time of each pass go to `stats.json`.
A block's result may count rows and lines apart (`rows_read`, `blank_lines`: a quoted field may
hold newlines, blank lines hold no row); Parquet inputs number rows, not lines (`unit`).
A multi-hot list longer than its `max_length` keeps its first (or last) `max_length` values; such rows
are counted per feature (`columns.<feature>.truncated_rows`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ctrflow.errors import UserError
from ctrflow.contract.features import FIRST_ID
from ctrflow.ingest.blocks import truncation_message
from ctrflow.contract.vocab import vocab_hash
from ctrflow.contract.schema import Schema


def file_stats(path: Path, split: str) -> dict:
    """A file's entry in stats.json, before any row is counted."""
    return {"path": str(path), "split": "train+valid" if split == "split" else split,
            "bytes": path.stat().st_size, "rows_read": 0, "rows_written": 0, "rows_rejected": 0}


def account_block(result: dict, files, per_file: list[dict], rejected, warnings: list[str]) -> None:
    """Turn block-relative lines into file lines (blocks arrive in order); stop or log bad rows."""
    index = result["file"]
    path, stats = files[index][0], per_file[index]
    base = stats.get("_lines", 0)  # lines before the block (= rows read, where a row is a line)
    unit = result.get("unit", "line")
    if result["truncated"]:
        tail = result["tail"]
        if rejected is None:
            raise UserError(truncation_message(path, base + (1 if tail else 0), tail))
        if tail:
            result["problems"] = [(0, "truncated gzip file: incomplete last line", tail)]
        else:
            warnings.append(truncation_message(path, base, tail))
    for line, reason, raw in result["problems"]:
        message = f"{path}: {unit} {base + line + 1}: {reason}"
        if rejected is None:
            raise UserError(message)
        stats.setdefault("_first_problem", message)
        text = raw.decode("utf-8", "replace").rstrip("\r").replace("\r", "\\r").replace("\n", "\\n")
        rejected.write(f"{path}\t{base + line + 1}\t{reason}\t{text}\n")
    stats["_lines"] = base + result["lines"]
    stats["rows_read"] += result.get("rows_read", result["lines"])
    stats["rows_written"] += result["rows"]["train"] + result["rows"]["valid"]
    stats["rows_rejected"] += len(result["problems"])
    if "blank_lines" in result:
        stats["blank_lines"] = stats.get("blank_lines", 0) + result["blank_lines"]


def check_rows_written(per_file: list[dict]) -> None:
    """A one-line UserError when rows were read but none written (every row bad and skipped): an empty
    dataset would look complete. Names the first rejected row."""
    read = sum(f["rows_read"] for f in per_file)
    if read and not sum(f["rows_written"] for f in per_file):
        first = next((f["_first_problem"] for f in per_file if f.get("_first_problem")), "")
        raise UserError(f"every input row was rejected ({read} read, 0 written; the first: {first}); "
                        "nothing was written")


def collect_stats(records, per_file, distinct: dict[str, int], tables, rows, warnings, passes, workers,
                  chunk_rows, dense: Sequence[str], sparse: Sequence[str],
                  max_lengths: Mapping[str, int] | None = None, truncated: Mapping[str, int] | None = None) -> dict:
    """stats.json's content (plus the cardinalities, vocab hash and training label sum that go to
    schema.json). `dense`, `sparse`: the feature columns in the records' `missing` order; `max_lengths`:
    the multi-hot features', `truncated`: the rows cut to it per feature."""
    written = rows["train"] + rows["valid"]
    width = len(dense) + len(sparse)
    missing = sum((r["missing"] for r in records), np.zeros(width, dtype=np.int64))
    columns = {name: {"missing_rate": round(float(missing[j]) / max(1, written), 6)} for j, name in enumerate(dense)}
    for j, name in enumerate(sparse):
        columns[name] = {"missing_rate": round(float(missing[len(dense) + j]) / max(1, written), 6),
                         "cardinality": len(tables[name]) + FIRST_ID, "distinct_train": distinct[name]}
        if max_lengths and name in max_lengths:
            columns[name].update(max_length=max_lengths[name], truncated_rows=int((truncated or {}).get(name, 0)))
    total = sum(passes.values())
    files = [{k: v for k, v in f.items() if not k.startswith("_")} for f in per_file]
    return {
        "rows_read": sum(f["rows_read"] for f in per_file),
        "rows_written": sum(f["rows_written"] for f in per_file),
        "rows_rejected": sum(f["rows_rejected"] for f in per_file),
        "rows": rows, "files": files, "columns": columns, "passes": passes,
        "rows_per_second": round(sum(f["rows_read"] for f in per_file) / total, 1) if total else None,
        "workers": workers, "chunk_rows": chunk_rows, "warnings": warnings,
        "cardinalities": {name: len(tables[name]) + FIRST_ID for name in sparse},
        "vocab_hash": vocab_hash({name: tables[name].column("value") for name in sparse}),
        "label_sum": sum(int(r.get("label_sum", 0)) for r in records),
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
