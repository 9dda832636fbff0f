"""Periodic validation during training: exact AUC, logloss and calibration over the valid split, and
the output-bias shift that calibrates the checkpoint written after it (`ctrflow.train.calibration`).

The split streams through `ctrflow.loaders.scan.ScanLoader` (bounded memory, each process its own
contiguous share); each process keeps its logits and labels (8 bytes a row), rank 0 gathers them,
computes the exact metrics and sends the three numbers to every process.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ctrflow.evaluate.scoring import score_batches
from ctrflow.loaders.scan import ScanLoader
from ctrflow.metrics import auc, calibrating_shift, logloss
from ctrflow.runtime import Runtime


def validate(model: nn.Module, loader: ScanLoader, runtime: Runtime,
             amp: torch.dtype | None = None) -> dict[str, float]:
    """`valid_metrics` over every row of `loader` (each process scores its share;
    every process returns the same numbers); `amp`: autocast dtype."""
    was_training = model.training
    model.eval()
    try:
        pad_to = loader.batch if runtime.distributed else None  # the same batch size on every process
        labels, logits = score_batches(model, loader.batches(), runtime.device, amp, pad_to)
    finally:
        model.train(was_training)
    return combine_metrics(labels, logits, runtime)


def combine_metrics(labels: np.ndarray, logits: np.ndarray, runtime: Runtime) -> dict[str, float]:
    """Exact metrics of every process's (labels, logits): computed on rank 0, sent to all."""
    if not runtime.distributed:
        return valid_metrics(labels, logits)
    parts = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object((labels, logits), parts, dst=0)  # rank 0 alone holds all scores (8 B a row)
    result = [None]
    if runtime.is_main:
        result[0] = valid_metrics(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    dist.broadcast_object_list(result, src=0)
    return result[0]


def valid_metrics(labels: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """`{"auc", "logloss", "rows", "calibration_ratio", "output_bias_shift"}`: AUC (ranked on the
    logits), logloss, row count, mean prediction / observed click rate, and the output-bias change that
    makes that ratio 1 (`calibrating_shift`)."""
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    rate = float(labels.mean()) if labels.size else 0.0
    return {"auc": auc(labels, logits), "logloss": logloss(labels, probs), "rows": int(labels.size),
            "calibration_ratio": float(probs.mean()) / rate if rate > 0 else float("nan"),
            "output_bias_shift": calibrating_shift(labels, logits)}
