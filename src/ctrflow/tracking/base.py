"""The interface every step logs through; the steps never ask whether MLflow is on."""

from __future__ import annotations

import os
from typing import Any, Mapping


class Tracker:
    """Logs params, metrics, tags and artifacts of one run (one pipeline step).

    Every method is a no-op here; `MlflowTracker` and `ChildTracker` override them. A tracker is a context
    manager: leaving it ends the run, marking it FAILED when an exception escaped.
    """

    run_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record hyper-parameters and settings (once per run)."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record scalar metrics, optionally at a training step."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Record searchable labels (KFP run id, git commit, schema hash...)."""

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Attach a file, or a whole directory, to the run."""

    def register_model(self, name: str, path: str | os.PathLike, **kwargs: Any) -> str | None:
        """Register the files of the local folder `path` as a new model version; returns the version."""
        return None

    def close(self, status: str = "FINISHED", end_ms: int | None = None) -> None:
        """End the run, at `end_ms` (ms since the epoch; default: now)."""

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # an exception may name its own status: a run stopped by a signal is KILLED, not FAILED
        self.close(getattr(exc, "run_status", "FAILED") if exc_type else "FINISHED")


class NullTracker(Tracker):
    """Tracks nothing: for tests, the GPU machine (no mlflow there) and `--tracking-uri none`."""
