"""What a run reports while it trains: `metrics.jsonl`, the tracker, a tqdm bar on a terminal."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ctrflow.errors import UserError
from ctrflow.tracking import Tracker
from ctrflow.runtime import Runtime, all_reduce_sum


class NonFiniteLoss(UserError):
    """The loss became NaN or infinite; training stopped without writing a checkpoint."""


class ProgressLog:
    """Accumulates per-step losses on the device and reports them every `log_every` steps.

    Losses stay on the device between reports: reading one is a device-to-host sync, so it
    happens only at report and checkpoint steps.
    """

    def __init__(self, out: Path, runtime: Runtime, tracker: Tracker, batch_size: int,
                 total_steps: int, start_step: int, show_bar: bool):
        self.path = out / "metrics.jsonl"
        self.runtime, self.tracker, self.batch_size = runtime, tracker, batch_size
        self.loss_sum = torch.zeros((), device=runtime.device, dtype=torch.float64)
        self.steps = 0
        self.last = {"loss": math.nan}
        self.mark = time.perf_counter()
        self.started, self.start_step = self.mark, start_step
        self.bar = _progress_bar(show_bar and runtime.is_main and sys.stderr.isatty(), total_steps, start_step)

    def add(self, loss: torch.Tensor) -> None:
        """One step's mean loss (a 0-d tensor on the device); no sync."""
        self.loss_sum += loss.detach().to(torch.float64)
        self.steps += 1
        if self.bar is not None:
            self.bar.update(1)

    def check_finite(self, step: int) -> None:
        """Raise `NonFiniteLoss` if any loss since the last report was NaN/inf (a sync)."""
        value = all_reduce_sum(float(self.loss_sum.item()), self.runtime)
        if not math.isfinite(value):
            raise NonFiniteLoss(f"the training loss became {value} by step {step}; training stopped "
                                f"(the last good checkpoint is kept; lower --lr or check the data)")

    def report(self, step: int, lr: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """Write one record: mean loss since the last report, lr, samples/s (+ `extra`)."""
        self.check_finite(step)
        now = time.perf_counter()
        loss = all_reduce_sum(float(self.loss_sum.item()), self.runtime) / self.runtime.world_size
        record: dict[str, Any] = {"step": step}
        if self.steps:
            record.update(loss=loss / self.steps, lr=lr,
                          samples_per_s=self.steps * self.batch_size / max(now - self.mark, 1e-9))
            self.last = record
        record.update(extra or {})
        self.loss_sum.zero_()
        self.steps = 0
        self.mark = now
        if self.runtime.is_main:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.tracker.log_metrics({k: v for k, v in record.items() if k != "step"}, step=step)
            if "loss" in record and self.bar is not None:
                self.bar.set_postfix({k: f"{record[k]:.4f}" for k in ("loss", "auc") if k in record})
        return record

    def pause(self) -> None:
        """Exclude time spent outside training steps (evaluation, checkpoints) from samples/s."""
        self.excluded_from = time.perf_counter()

    def resume(self) -> None:
        """End a `pause`."""
        paused = time.perf_counter() - self.excluded_from
        self.mark += paused
        self.started += paused

    def throughput(self, step: int) -> float:
        """Mean samples/s of this process's steps so far (excluding pauses)."""
        return (step - self.start_step) * self.batch_size / max(time.perf_counter() - self.started, 1e-9)

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


def _progress_bar(enabled: bool, total: int, initial: int):
    """A tqdm bar, or None when off or tqdm is absent (the GPU machine has none)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def restart_metrics(out: Path, source: Path | None, until_step: int) -> None:
    """Start `out/metrics.jsonl` with the records of `source` up to `until_step` (a resumed run
    rewrites what came after its checkpoint); empty when `source` is None."""
    lines: list[str] = []
    if source is not None and source.exists():
        for line in source.read_text().splitlines():
            try:
                if json.loads(line).get("step", math.inf) <= until_step:
                    lines.append(line)
            except json.JSONDecodeError:  # a line cut short by a killed run
                continue
    path = out / "metrics.jsonl"
    tmp = path.with_name("metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)
