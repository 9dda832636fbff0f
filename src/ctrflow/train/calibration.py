"""The calibration of a kept model: its output bias fitted on the validation split.

Trained on rare clicks, a model may rank well while its mean prediction on new rows drifts from the
observed rate (1.37 times it after two epochs on a public news-click sample with 4 % clicks): logits that
fit the training rows closely are noisy on new ones, and below 0.5 the sigmoid is convex, so the noise
raises the mean prediction. Every checkpoint
written right after a validation therefore holds, as the model's own output bias, the bias that makes
the mean prediction on the validation split equal its click rate (`ctrflow.metrics.
calibrating_shift`: the bias minimizing that split's logloss with every other weight fixed; the ranking,
and so the AUC, is unchanged). Evaluate, predict, export and serving read it like any other weight.
`meta.json`'s `calibration` records the shift and the bias training had, which `--resume` puts back:
a resumed run continues the trajectory of the run it continues (a warm start, `--init-from`, begins
from the calibrated model).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

METHOD = "output bias fitted on the validation split (mean prediction = observed click rate)"


@contextmanager
def calibrated(model: nn.Module, valid: dict[str, float] | None, enabled: bool = True) -> Iterator[dict | None]:
    """Within the block, `model`'s output bias moved by the validation's `output_bias_shift`; yields the
    record for the checkpoint's meta.json (None, and the model untouched: no validation, or disabled)."""
    shift = (valid or {}).get("output_bias_shift")
    if not enabled or shift is None or not math.isfinite(shift):
        yield None
        return
    bias = model.output_bias
    trained = bias.detach().clone()
    with torch.no_grad():
        bias.add_(shift)
    try:
        yield {"method": METHOD, "output_bias_shift": shift, "trained_output_bias": float(trained.item()),
               "valid_rows": valid["rows"], "calibration_ratio_before": valid["calibration_ratio"]}
    finally:
        with torch.no_grad():
            bias.copy_(trained)


def restore_trained_bias(model: nn.Module, meta: dict[str, Any]) -> None:
    """Put back the output bias training had, where the checkpoint holds a calibrated one (resume)."""
    record = meta.get("calibration")
    if record:
        with torch.no_grad():
            model.output_bias.fill_(record["trained_output_bias"])
