"""The best checkpoint of a run, and early stopping.

Each validation during training is offered to `BestCheckpoint`: a validation AUC above every earlier
one is an improvement, and the loop then writes a checkpoint at that step (even between its regular
checkpoints) and points the run directory's `best` file at it (`ctrflow.checkpoint`: never pruned;
what evaluate, export and predict read by default). With `early_stopping` N > 0 the run stops after
N validations in a row without an improvement, writing its last checkpoint (`latest`, what
`--resume` continues from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctrflow import checkpoint
from ctrflow.errors import UserError


@dataclass
class BestCheckpoint:
    """The best validation so far (`auc`, `step`; None before the first) and the validations since."""

    patience: int = 0  # early stopping after this many validations without improvement; 0: never
    auc: float | None = None
    step: int | None = None
    since: int = 0

    @classmethod
    def start(cls, out: Path, patience: int, resumed: bool, is_main: bool) -> "BestCheckpoint":
        """A resumed run continues from its directory's `best`; a fresh run forgets any older one
        (a `best` of an earlier run in the same directory would otherwise be read as this run's)."""
        if patience < 0:
            raise UserError(f"early_stopping must be 0 (never) or a number of validations, got {patience}")
        if resumed:
            found = checkpoint.best_step(out)
            if found is not None and found["auc"] is not None:
                return cls(patience, found["auc"], found["step"])
        elif is_main:
            (out / checkpoint.BEST).unlink(missing_ok=True)
        return cls(patience)

    def offer(self, step: int, auc: float) -> bool:
        """Record a validation; whether it is the best so far (a NaN AUC never is)."""
        if not math.isnan(auc) and (self.auc is None or auc > self.auc):
            self.auc, self.step, self.since = auc, step, 0
            return True
        self.since += 1
        return False

    @property
    def stop(self) -> bool:
        """Whether early stopping ends the run now."""
        return self.patience > 0 and self.since >= self.patience

    def note(self, improved: bool) -> str:
        """What the last `offer` meant, for the validation's line: best so far, or the best's AUC and
        step, and early stopping when it ends the run."""
        text = " (best so far)" if improved else (
            f" (best {self.auc:.4f} at step {self.step})" if self.auc is not None else "")
        if self.stop:
            text += f"; early stopping: {self.since} validations without improvement"
        return text

    def summary(self, out: Path) -> dict[str, Any]:
        """`best_step`, `best_valid_auc`, `best_checkpoint` for the run's summary (empty: never validated)."""
        if self.step is None:
            return {}
        return {"best_step": self.step, "best_valid_auc": self.auc,
                "best_checkpoint": str(out / f"step_{self.step:08d}")}
