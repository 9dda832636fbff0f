"""What every synthetic generator shares: its arguments checked, its files written atomically, its run tracked."""

from __future__ import annotations

import os
from pathlib import Path

from ctrflow.errors import UserError
from ctrflow.synth.drift import check_drift


def open_out(out, rows: int, days: int, seed: int, drift: float) -> Path:
    """The output directory, created, once the arguments are checked (one-line `UserError`s)."""
    check_drift(drift)
    if rows < 1 or days < 1:
        raise UserError(f"--rows and --days must be at least 1 (got rows={rows}, days={days})")
    if seed < 0:
        raise UserError(f"--seed must be non-negative (got {seed})")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: --out must be a directory, this is a file")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write `text` under a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def track(tracker, params: dict, report: dict, seconds: float, artifacts: list[Path]) -> None:
    """Log a generator's run: its parameters, each day's teacher AUC and click rate, its speed and files."""
    tracker.log_params(params)
    metrics = {f"teacher_auc_{k}": v for k, v in report["teacher_auc"].items()}
    metrics.update({f"ctr_{k}": v for k, v in report["ctr"].items()})
    tracker.log_metrics({**metrics, "rows_per_s": report["rows"] * report["days"] / seconds})
    for path in artifacts:
        tracker.log_artifact(path)
