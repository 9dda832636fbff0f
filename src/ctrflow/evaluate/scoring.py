"""A model's logits over a loader's batches, kept as 8 bytes a row (logit and label, float32).

Evaluation of a whole day (~178 M rows) keeps only what the exact metrics need: the split itself
streams through `ctrflow.loaders.scan.ScanLoader`. Device results are fetched once per
`FLUSH_ROWS` rows, not once per batch, so the device never waits on the host between batches.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ctrflow.loaders.batch import Batch

FLUSH_ROWS = 1 << 20  # rows of device results held before one copy to the host (8 MiB)


@torch.no_grad()
def score_batches(model: nn.Module, batches: Iterable[Batch], device: torch.device | str,
                  amp: torch.dtype | None = None, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(labels [N] f32, logits [N] f32) of every batch, in batch order; `amp`: autocast dtype.

    `pad_to`: every batch goes through the model as `pad_to` rows (zeros after its own, their
    logits dropped). Under torchrun the fused sharded tables need the same batch size on every
    process (their all-to-alls size what each process receives by its own batch), while the
    processes' shares of a split differ by a row and end in short or empty batches."""
    device = torch.device(device)
    labels: list[np.ndarray] = []
    logits: list[np.ndarray] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    held = 0
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        dense, sparse = batch.dense, batch.sparse
        if pad_to is not None and len(batch) < pad_to:
            dense = F.pad(dense, (0, 0, 0, pad_to - len(batch)))
            sparse = F.pad(sparse, (0, 0, 0, pad_to - len(batch)))  # id 0 (missing) is in every table
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            out = model(dense, sparse)
        pending.append((batch.labels, out.float().reshape(-1)[:len(batch)]))
        held += len(batch)
        if held >= FLUSH_ROWS:
            _flush(pending, labels, logits)
            held = 0
    _flush(pending, labels, logits)
    if not labels:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(labels), np.concatenate(logits)


def _flush(pending: list, labels: list, logits: list) -> None:
    """Move the pending device results to host arrays (a device-to-host sync)."""
    if pending:
        labels.append(torch.cat([lab for lab, _ in pending]).cpu().numpy())
        logits.append(torch.cat([out for _, out in pending]).cpu().numpy())
        pending.clear()
