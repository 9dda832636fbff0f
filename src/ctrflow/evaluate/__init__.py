"""`ctrflow evaluate`: exact AUC, logloss and calibration of a checkpoint over a whole split.

The split is read in order, row group by row group (`ctrflow.loaders.scan.ScanLoader`: background
decode, page-locked windows copied to the GPU), so a day of Criteo-1TB (~178 M rows, ~28 GB)
needs only the buffers and the scores and labels kept for the exact metrics (8 bytes a row).
Writes `OUT/metrics.json`, `OUT/roc.png` and `OUT/calibration.png`, and logs them to the tracker.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from ctrflow.evaluate.plots import plot_calibration, plot_roc
from ctrflow.metrics import auc, calibration, logloss, roc_curve
from ctrflow.tracking import NullTracker, Tracker

__all__ = ["auc", "calibration", "compute_metrics", "evaluate", "logloss"]


def compute_metrics(labels: np.ndarray, logits: np.ndarray, bins: int = 10) -> dict:
    """Every metric of `metrics.json` from 0/1 labels and logits, both [N].

    AUC is ranked on the logits (sigmoid in float32 would tie scores that the model separates);
    probabilities are taken in float64 for logloss and calibration.
    """
    labels = np.asarray(labels, dtype=np.float64)
    probs = np.exp(-np.logaddexp(0.0, -np.asarray(logits, dtype=np.float64)))  # sigmoid without overflow
    table = calibration(labels, probs, bins=bins)
    ctr = table["observed_ctr"]
    base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)) if 0 < ctr < 1 else float("nan")
    loss = logloss(labels, probs)
    return {
        "auc": auc(labels, logits),
        "logloss": loss,
        "normalized_entropy": loss / base,  # logloss relative to always predicting the base rate
        "rows": int(labels.size),
        "positives": int(labels.sum()),
        "mean_prediction": table["mean_prediction"],
        "observed_ctr": ctr,
        "calibration_ratio": table["ratio"],  # mean prediction / observed click rate (1: calibrated on average)
        "ece": table["ece"],  # expected calibration error over `bins` equal-mass bins
        "calibration": table,
    }


def _json_safe(value):
    """NaN -> null: strict JSON readers (and MLflow) reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def write_plots(labels: np.ndarray, logits: np.ndarray, metrics: dict, out: Path) -> None:
    """roc.png and calibration.png; skipped with a note where matplotlib is absent (the GPU image)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("ctrflow evaluate: matplotlib not installed; no plots written", file=sys.stderr)
        return
    if not math.isnan(metrics["auc"]):
        fpr, tpr = roc_curve(labels, logits)
        plot_roc(fpr, tpr, metrics["auc"], out / "roc.png")
    if metrics["rows"]:
        plot_calibration(metrics["calibration"], out / "calibration.png")


def keep_tables_within(model, budget_gib: float, batch_size: int, device) -> str:
    """Scoring with tables larger than the device: the model's embedding tables beyond `budget_gib` of
    device memory (weights alone: nothing trains) stay in host memory, each read through a device cache
    of the rows the batches look up (`ctrflow.embedding.placement`, `ctrflow.embedding.cache`), the rest
    go to the device with the model; returns the placement ("device 20, host 6 (caches of ... rows)").
    Wide & Deep's and DeepFM's first-order tables (dim 1) always stay on the device, within the budget."""
    from ctrflow.embedding.placement import HostTier, place_in_budget, placement_summary
    from ctrflow.embedding.plan import plan_sharding

    tables = model.embeddings.tables
    linear = getattr(model, "linear_embeddings", None)
    small = sum(t.num_embeddings * 4 for t in linear.tables) if linear is not None else 0
    tier = HostTier(int(budget_gib * 2**30) - small, batch_size)
    plan = place_in_budget(plan_sharding(tables, 1), tables, tier, lambda t: t.bytes)
    for name, shard in plan.on_host():
        model.embeddings.place_on_host(name, shard.cache_rows, device)
    return placement_summary(plan)


def evaluate(data: str | os.PathLike, checkpoint: str | os.PathLike, out: str | os.PathLike,
             split: str = "valid", batch_size: int = 16384, bins: int = 10, device: str = "cpu",
             tracker: Tracker | None = None, threads: int | None = None,
             embedding_memory_gib: float | None = None) -> dict:
    """Score `data/split` with `checkpoint`; write metrics.json and the plots to `out`; return the metrics.

    `device` ("cpu", "cuda", "auto") is where the model scores; metrics are computed on the host.
    `threads`: Parquet decode threads (default: the usable cores, at most 16). `embedding_memory_gib`:
    the device memory the tables may take; the rest are read through a device cache of the rows the
    batches use (`keep_tables_within`; None: every table on the device).
    """
    import torch

    from ctrflow.loaders.scan import ScanLoader
    from ctrflow.loaders.stream_plan import ParquetIndex
    from ctrflow.evaluate.scoring import score_batches
    from ctrflow.predict import load_for_data

    tracker = tracker or NullTracker()
    model, schema, meta = load_for_data(checkpoint, data)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    placement = (keep_tables_within(model, embedding_memory_gib, batch_size, device)
                 if embedding_memory_gib is not None else None)
    model.to(device)
    loader = ScanLoader(ParquetIndex(data, split), batch_size, table_sizes=schema.table_sizes(), device=device,
                        threads=threads)
    labels, logits = score_batches(model, loader.batches(), device)
    if labels.size != len(loader.dataset):  # row accounting: every row of the split is scored once
        raise RuntimeError(f"{data}/{split}: scored {labels.size} of {len(loader.dataset)} rows")
    metrics = compute_metrics(labels, logits, bins=bins)
    metrics.update(split=split, data=str(data), checkpoint=str(checkpoint),
                   model=meta.get("model", {}).get("name"), step=meta.get("step"),
                   checkpoint_calibration=meta.get("calibration"))  # what training fitted (None: nothing)
    if placement is not None:
        metrics["embedding_placement"] = placement

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(_json_safe(metrics), indent=2) + "\n")
    write_plots(labels, logits, metrics, out)

    tracker.log_params({"split": split, "data": str(data), "checkpoint": str(checkpoint)})
    tracker.set_tags({"schema_hash": schema.vocab_hash})
    scalars = {k: metrics[k] for k in ("auc", "logloss", "normalized_entropy", "rows", "mean_prediction",
                                      "observed_ctr", "calibration_ratio", "ece")}
    tracker.log_metrics({k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(v)})
    for name in ("metrics.json", "roc.png", "calibration.png"):
        if (out / name).exists():
            tracker.log_artifact(out / name, "evaluate")
    return metrics
