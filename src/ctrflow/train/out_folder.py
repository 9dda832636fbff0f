"""`train --out DIR` when DIR already holds a run: continue it (`--resume`), start over
(`--overwrite`), or refuse, so that earlier training is never lost silently."""

from __future__ import annotations

import shutil
from pathlib import Path

from ctrflow.config import TrainConfig
from ctrflow.errors import UserError

# what a training run writes into --out; --overwrite removes exactly these (other files stay)
RUN_FILES = ("latest", "best", "metrics.jsonl", "train_summary.json", "config.json")
STEP_DIRS = ("step_*", ".tmp-step_*")


def run_files(out: Path) -> list[Path]:
    """The files and step folders of an earlier run in `out` (empty when it holds none)."""
    if not out.is_dir():
        return []
    found = [out / name for name in RUN_FILES if (out / name).exists()]
    found += sorted(p for pattern in STEP_DIRS for p in out.glob(pattern) if p.is_dir())
    return found


def claim_out(config: TrainConfig, is_main: bool) -> None:
    """Check `config.out` before any work: a folder holding a run needs `--resume` or
    `--overwrite`; with `--overwrite`, the main process removes that run's files first."""
    out = Path(config.out)
    if config.overwrite and config.resume:
        raise UserError("--overwrite starts over and --resume continues: give one of them")
    found = run_files(out)
    if not found or config.resume:
        return
    if not config.overwrite:
        latest = out / "latest"
        what = latest.read_text().strip() if latest.exists() else found[0].name
        raise UserError(f"--out {out}: holds a training run ({what}); add --resume {out} to continue it "
                        f"or --overwrite to start over")
    if is_main:
        for path in found:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
