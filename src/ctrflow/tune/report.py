"""How a training run tells a tuning service its validation metrics: `ctrflow train --report-metrics`.

The training loop calls `reporter.report(step, epoch, metrics)` after every validation (on the main
process), as it calls the tracker; `Reporter` does nothing, and the loop never asks which services
listen. So the training image runs unchanged as a trial of:

- **Vertex AI** hyperparameter tuning (`vertex`): the file `cloudml-hypertune` writes, without that
  package. Each report adds one JSON object (keys sorted) `{"checkpoint_path": "", "global_step":
  "<step>", "<tag>": "<value>", "timestamp": <unix seconds>, "trial": "<trial id>"}` and the file is
  rewritten with the newest 100 of them, one a line, at `$CLOUD_ML_HP_METRIC_FILE`, else
  `/tmp/hypertune/output.metrics`; the trial id is `$CLOUD_ML_TRIAL_ID` (else 0); values are strings,
  as the package writes them. The tag is the study's metric id (`auc`).
- **Katib** (`katib`), through its StdOut metrics collector: one stdout line per report, an RFC 3339
  timestamp first (the collector's time of the observation) then `name=value` pairs —
  `2026-01-02T03:04:05.678901Z epoch=1 step=400 auc=0.781234 logloss=0.452100` — which Katib's
  default filter `([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)` reads as metrics `epoch`,
  `step`, `auc` and `logloss`. Values are fixed-point (older collectors' filter has no exponent);
  non-finite values are left out (the filter would read them as empty).
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Iterable, Mapping

from ctrflow.errors import UserError

SERVICES = ("vertex", "katib", "none")
VERTEX_FILE = "/tmp/hypertune/output.metrics"  # cloudml-hypertune's default
VERTEX_KEEP = 100  # entries cloudml-hypertune keeps in the file


class Reporter:
    """Receives the validation metrics of a training run; does nothing here (services override)."""

    def report(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """One validation's `{"auc", "logloss", "rows"}` after `step` training steps, `epoch` epochs done."""


class Reporters(Reporter):
    """Several reporters as one."""

    def __init__(self, reporters: Iterable[Reporter]):
        self.reporters = list(reporters)

    def report(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """Report to each."""
        for reporter in self.reporters:
            reporter.report(step, epoch, metrics)


class VertexReporter(Reporter):
    """The metrics file of Vertex AI hyperparameter tuning, as `cloudml-hypertune` writes it (module doc)."""

    def __init__(self, tag: str = "auc", path: str | os.PathLike | None = None, trial: str | None = None):
        self.tag = tag
        self.path = Path(path or os.environ.get("CLOUD_ML_HP_METRIC_FILE", VERTEX_FILE))
        self.trial = str(trial if trial is not None else os.environ.get("CLOUD_ML_TRIAL_ID", 0))
        self.entries: collections.deque = collections.deque(maxlen=VERTEX_KEEP)

    def report(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """Add one entry for the tagged metric and rewrite the file (atomically: the service may read it
        at any time)."""
        if self.tag not in metrics:
            return
        self.entries.append({"timestamp": time.time(), "trial": self.trial, self.tag: str(float(metrics[self.tag])),
                             "global_step": str(int(step) if step else 0), "checkpoint_path": ""})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(json.dumps(entry, sort_keys=True) + "\n" for entry in self.entries))
        os.replace(tmp, self.path)


class KatibReporter(Reporter):
    """Lines for Katib's StdOut metrics collector (module doc)."""

    def __init__(self, stream: IO[str] | None = None, names: tuple[str, ...] = ("auc", "logloss")):
        self.stream = stream
        self.names = names

    def report(self, step: int, epoch: int, metrics: Mapping[str, float]) -> None:
        """Print `TIMESTAMP epoch=E step=S auc=X logloss=Y` and flush."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        pairs = [f"epoch={int(epoch)}", f"step={int(step)}"]
        pairs += [f"{name}={float(metrics[name]):.6f}" for name in self.names
                  if name in metrics and math.isfinite(float(metrics[name]))]
        print(stamp, *pairs, file=self.stream or sys.stdout, flush=True)


def reporters_for(names: Iterable[str] | None) -> Reporter:
    """The reporter `--report-metrics` asks for (names: vertex, katib, none; comma-separated allowed)."""
    chosen: list[str] = []
    for name in (part.strip() for value in (names or ()) for part in value.split(",")):
        if name not in SERVICES:
            raise UserError(f"--report-metrics: {name!r} is not one of {', '.join(SERVICES)}")
        if name != "none" and name not in chosen:
            chosen.append(name)
    made = [VertexReporter() if name == "vertex" else KatibReporter() for name in chosen]
    return made[0] if len(made) == 1 else Reporters(made)


__all__ = ["KatibReporter", "Reporter", "Reporters", "SERVICES", "VERTEX_FILE", "VertexReporter", "reporters_for"]
