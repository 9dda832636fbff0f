"""The study in MLflow: one parent run, a child run per trial, the best tagged, the results attached.

The tuning process logs every run itself (its trials train with tracking off): a child run opens
when its trial starts (params: the sampled values), gets the metric at each validation (MLflow step:
the training step) as the trial's metrics.jsonl shows it, and closes with `best_<metric>`,
`duration_s`, `pruned`, the tags `tune.state` and `tune.trial`, and the trial's `trial.yaml` and
`config.json` as artifacts — FINISHED (complete or pruned), FAILED, or KILLED when the study was
interrupted. So a pruned trial, stopped from outside, still has a closed run, and the trials spend
no time on tracking. The parent run's id is recorded in the study: a resumed study logs into the
same parent. `StudyTracking()` with no URI tracks nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ctrflow.tracking import NullTracker, Tracker, make_tracker, resolve_tracking_uri

RUN_ATTR = "ctrflow.mlflow_run_id"
STATUS = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED"}


class StudyTracking:
    """MLflow runs of one study (or nothing, when tracking is off)."""

    def __init__(self, study=None, uri: str | None = "none", experiment: str = "ctrflow",
                 parent_run_id: str | None = None, tags: dict[str, str] | None = None,
                 params: dict[str, Any] | None = None):
        self.uri, self.experiment = resolve_tracking_uri(uri), experiment
        self.trials: dict[str, Tracker] = {}
        self.parent: Tracker = NullTracker()
        if study is None or self.uri.lower() == "none":
            return
        existing = study.user_attrs.get(RUN_ATTR)
        if existing and existing.get("uri") == self.uri:
            self.parent = self._reopen(existing["run_id"])
        if self.parent.run_id is None:
            self.parent = make_tracker(self.uri, experiment, f"tune {study.study_name}", parent_run_id,
                                       {**(tags or {}), "ctrflow.step": "tune", "tune.study": study.study_name})
            if self.parent.run_id:
                study.set_user_attr(RUN_ATTR, {"uri": self.uri, "run_id": self.parent.run_id})
                self.parent.log_params(params or {})
        self.study_name = study.study_name

    def _reopen(self, run_id: str) -> Tracker:
        try:
            from ctrflow.tracking.mlflow_tracker import MlflowTracker

            return MlflowTracker(self.uri, run_id=run_id)
        except Exception:  # deleted, or another store: a new parent run is made instead
            return NullTracker()

    @property
    def on(self) -> bool:
        """Whether runs are being logged."""
        return self.parent.run_id is not None

    def trial_started(self, number: int, values: dict[str, Any], directory: Path) -> str | None:
        """Open trial `number`'s child run with its sampled values; returns its run id."""
        if not self.on:
            return None
        run = make_tracker(self.uri, self.experiment, f"trial {number}", self.parent.run_id,
                           {"ctrflow.step": "tune.trial", "tune.study": self.study_name, "tune.trial": str(number),
                            "tune.directory": str(directory)})
        run.log_params({k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in values.items()})
        self.trials[run.run_id] = run
        return run.run_id

    def trial_value(self, run_id: str | None, metric: str, value: float, step: int) -> None:
        """One validation's metric of a running trial."""
        if run_id in self.trials and math.isfinite(value):
            self.trials[run_id].log_metrics({metric: value}, step=step)

    def trial_finished(self, trial, metric: str) -> None:
        """Close trial's run (an Optuna FrozenTrial, finished) with its summary."""
        run = self.trials.pop(trial.user_attrs.get("mlflow_run_id"), None)
        if run is None:
            return
        values = [v for _, v in sorted(trial.intermediate_values.items())]
        finite = [v for v in values if math.isfinite(v)]
        better = max if metric == "auc" else min
        summary = {"duration_s": float(trial.user_attrs.get("seconds", 0.0)), "validations": float(len(values)),
                   "pruned": float(trial.state.name == "PRUNED")}
        if finite:
            summary[f"best_{metric}"] = better(finite)
        run.log_metrics(summary)
        run.set_tags({"tune.state": trial.state.name, "tune.pruned": str(trial.state.name == "PRUNED").lower()})
        directory = Path(trial.user_attrs.get("directory", ""))
        for name in ("trial.yaml", "config.json"):
            if (directory / name).is_file():
                run.log_artifact(directory / name)
        run.close(STATUS.get(trial.state.name, "FAILED"))

    def close_run(self, run_id: str | None, status: str) -> None:
        """End a trial's run that will not finish (KILLED): its trial was interrupted."""
        if not run_id or not self.on:
            return
        run = self.trials.pop(run_id, None) or self._reopen(run_id)
        run.set_tags({"tune.state": "INTERRUPTED"})
        run.close(status)

    def study_finished(self, study, metric: str, files: list[Path], states: dict[str, int]) -> None:
        """Tag the best trial's run (`tune.best=true`, the others false) and the parent (`tune.best_trial`,
        `tune.best_run_id`, metric `best_<metric>`); attach `files` (best.yaml, trials.csv, plots) and
        the trials per state to the parent."""
        if not self.on:
            return
        from ctrflow.tune.results import ranked

        best = (ranked(study) or [None])[0]
        for t in study.get_trials(deepcopy=False):
            run_id = t.user_attrs.get("mlflow_run_id")
            if run_id and t.state.name in ("COMPLETE", "PRUNED"):
                self._reopen(run_id).set_tags({"tune.best": str(best is not None and t.number == best.number).lower()})
        if best is not None:
            self.parent.set_tags({"tune.best_trial": str(best.number),
                                  "tune.best_run_id": str(best.user_attrs.get("mlflow_run_id", ""))})
            self.parent.log_metrics({f"best_{metric}": best.value, "best_trial": float(best.number)})
        self.parent.log_metrics({f"trials_{k.lower()}": float(v) for k, v in states.items()})
        for path in files:
            if path.is_file():
                self.parent.log_artifact(path, "plots" if path.suffix == ".png" else None)

    def close(self, status: str = "FINISHED") -> None:
        """End the parent run."""
        self.parent.close(status)


__all__ = ["RUN_ATTR", "StudyTracking"]
