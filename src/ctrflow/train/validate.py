"""Periodic validation during training: exact AUC and logloss over the valid split."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ctrflow.data.loader import BatchLoader
from ctrflow.evaluate.metrics import auc, logloss
from ctrflow.train.distributed import Runtime, gather_arrays


@torch.no_grad()
def validate(model: nn.Module, loader: BatchLoader, runtime: Runtime,
             amp: torch.dtype | None = None) -> dict[str, float]:
    """`{"auc", "logloss", "rows"}` over every row of `loader` (each process scores its share;
    the scores are gathered, so every process returns the same numbers); `amp`: autocast dtype."""
    was_training = model.training
    model.eval()
    labels, scores = [], []
    for batch in loader.batches(0):
        batch = batch.to(runtime.device, non_blocking=True)
        with torch.autocast(runtime.device.type, dtype=amp or torch.float32, enabled=amp is not None):
            logits = model(batch.dense, batch.sparse)
        scores.append(logits.float().cpu().numpy())  # a device-to-host sync per batch
        labels.append(batch.labels.cpu().numpy())
    model.train(was_training)
    all_labels = gather_arrays(np.concatenate(labels) if labels else np.zeros(0, np.float32), runtime)
    all_logits = gather_arrays(np.concatenate(scores) if scores else np.zeros(0, np.float32), runtime)
    probs = 1.0 / (1.0 + np.exp(-all_logits.astype(np.float64)))
    return {"auc": auc(all_labels, all_logits), "logloss": logloss(all_labels, probs), "rows": int(all_labels.size)}
