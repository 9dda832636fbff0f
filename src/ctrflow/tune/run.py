"""`tune`: check the inputs, open the study, run its trials, write the results — `ctrflow tune` in one call.

A pipeline stage can call `tune` as it is (one task running P trials), or split it: `prepare` and
`open_study` in each worker task, `run_trials` against one shared storage URL, and `write_results`
once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ctrflow.config.files import load_config
from ctrflow.errors import UserError
from ctrflow.contract.schema import Schema
from ctrflow.tune.results import drop_checkpoints, summary, write_best, write_plots, write_trials_csv
from ctrflow.tune.space import THRESHOLD, read_space
from ctrflow.tune.runner import run_trials
from ctrflow.tune.study import StudySettings, open_study
from ctrflow.tune.tracking import StudyTracking
from ctrflow.tune.trial import METRIC_KEYS
from ctrflow.tune.view import check_threshold


@dataclass(frozen=True)
class TuneOptions:
    """How many trials, how many at once, for how long, where the study lives."""

    trials: int = 16
    parallel: int = 1
    budget_minutes: float | None = None
    storage: str | None = None  # default: sqlite:///OUT/study.db
    study: str = "ctrflow-tune"
    sampler: str = "tpe"
    pruner: str = "median"
    keep_best: int = 3


def prepare(data: str | Path, space: str | Path, out: str | Path, model: str | None = None,
            config: str | None = None, metric: str = "auc", evals_per_epoch: int = 4) -> StudySettings:
    """The study's settings, every input checked (one-line `UserError`s, before any trial starts):
    the data has a schema and a validation split, the space names known fields with non-empty ranges
    and no threshold below the data's, the base config loads."""
    data = Path(data).resolve()
    Schema.load(data)  # a processed-data folder, or a one-line error
    if not any((data / "valid").glob("part-*.parquet")):
        raise UserError(f"{data}: no validation split (valid/part-*.parquet): trials are compared on it; "
                        f"preprocess with --valid FILE or --valid-fraction F")
    if metric not in METRIC_KEYS:
        raise UserError(f"--metric must be one of {', '.join(METRIC_KEYS)}, got {metric!r}")
    if evals_per_epoch < 1:
        raise UserError(f"--evals-per-epoch must be at least 1, got {evals_per_epoch}")
    searched = read_space(space)
    threshold = searched.threshold()
    if threshold is not None:
        lowest = min(threshold.choices) if threshold.kind == "choice" else threshold.low
        check_threshold(data, lowest, f"{space}: {THRESHOLD}")
    overrides = {"data.path": str(data), **({"model.name": model} if model else {})}
    base = load_config(config, overrides)
    return StudySettings(data=data, base=base, space=searched, out=Path(out).resolve(), metric=metric,
                         evals_per_epoch=evals_per_epoch)


def check_options(options: TuneOptions) -> None:
    """UserError for counts that cannot work (`--parallel` above `--trials`, ...)."""
    from ctrflow.tune.study import PRUNERS, SAMPLERS

    if options.trials < 1:
        raise UserError(f"--trials must be at least 1, got {options.trials}")
    if options.parallel < 1:
        raise UserError(f"--parallel must be at least 1, got {options.parallel}")
    if options.parallel > options.trials:
        raise UserError(f"--parallel {options.parallel} is larger than --trials {options.trials}: "
                        f"at most {options.trials} trials can run at once")
    if options.keep_best < 0:
        raise UserError(f"--keep-best must be 0 or more, got {options.keep_best}")
    if options.budget_minutes is not None and options.budget_minutes <= 0:
        raise UserError(f"--budget-minutes must be positive, got {options.budget_minutes}")
    if options.sampler not in SAMPLERS:
        raise UserError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {options.sampler!r}")
    if options.pruner not in PRUNERS:
        raise UserError(f"--pruner must be one of {', '.join(PRUNERS)}, got {options.pruner!r}")


def write_results(study, out: str | Path, metric: str, keep_best: int) -> list[Path]:
    """best.yaml (when a trial completed), trials.csv and the plots under `out`; checkpoints of all
    but the best `keep_best` trials deleted. Returns the files written."""
    out = Path(out)
    drop_checkpoints(study, keep_best)
    files = [write_trials_csv(study, out, metric)]
    best = write_best(study, out, metric)
    if best is not None:
        files.append(best)
    files += [Path(p) for p in write_plots(study, out).values() if p.endswith(".png")]
    return files


def tune(settings: StudySettings, options: TuneOptions, tracking: dict[str, Any] | None = None,
         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the study to `options.trials` trials and write its results; `tracking`: `make_tracker`'s
    settings (`uri`, `experiment`, `parent_run_id`, `tags`), None for none. Returns the summary."""
    check_options(options)
    study = open_study(settings, options.storage, options.study, options.sampler, options.pruner, options.trials)
    tracked = StudyTracking(study.optuna, **(tracking or {}),
                            params={"data": str(settings.data), "model": settings.base.model.name,
                                    "trials": options.trials, "parallel": options.parallel,
                                    "metric": settings.metric, "sampler": options.sampler,
                                    "pruner": options.pruner, "storage": study.url, "study": study.name,
                                    "space": settings.space.describe()})
    status = "FAILED"
    try:
        budget = options.budget_minutes * 60 if options.budget_minutes else None
        run_trials(study, options.trials, options.parallel, budget, options.keep_best, tracked, log)
        files = write_results(study.optuna, settings.out, settings.metric, options.keep_best)
        result = summary(study.optuna, settings.metric)
        tracked.study_finished(study.optuna, settings.metric, files, result["states"])
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracked.close(status)
    return {**result, "files": [str(f) for f in files], "storage": study.url, "study": study.name}


__all__ = ["TuneOptions", "check_options", "prepare", "tune", "write_results"]
