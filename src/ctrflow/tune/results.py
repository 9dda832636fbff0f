"""What a study leaves: `best.yaml`, `trials.csv`, the plots, and the checkpoints of the best trials.

Everything here is read from the study's storage (each trial records its directory, its whole
config, its validations' steps and its duration as user attributes), so any worker — or a final
pipeline step — can write the results of trials that other workers ran.
"""

from __future__ import annotations

import csv
import io
import math
import os
import shutil
from pathlib import Path
from typing import Any

from ctrflow.config import TrainConfig
from ctrflow.config.files import to_yaml
from ctrflow.tune.trial import DIRECTIONS

PLOTS = ("optimization_history", "parallel_coordinate", "param_importances")


def ranked(study) -> list:
    """The COMPLETE trials, best first."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return sorted(done, key=lambda t: t.value, reverse=study.direction.name == "MAXIMIZE")


def drop_checkpoints(study, keep_best: int) -> list[int]:
    """Delete the checkpoints (`step_*`, `latest`) of every trial of this machine but the best
    `keep_best` complete ones; metrics.jsonl, config.json, trial.yaml and train.log stay. Returns the
    trials whose checkpoints went."""
    kept = {t.number for t in ranked(study)[:keep_best]}
    dropped = []
    for t in study.get_trials(deepcopy=False):
        directory = t.user_attrs.get("directory")
        if t.number in kept or not directory or t.state.name == "RUNNING" or not Path(directory).is_dir():
            continue
        steps = [p for p in Path(directory).iterdir()
                 if p.name.startswith("step_") or p.name in ("latest", "best")]
        for path in steps:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if steps:
            dropped.append(t.number)
    return dropped


def best_config(study, out: str | Path) -> tuple[Any, TrainConfig]:
    """(best trial, its whole config training into `out`): what `best.yaml` holds."""
    trials = ranked(study)
    if not trials:
        return None, TrainConfig()
    best = trials[0]
    # threads and the progress bar are the trial's share of this machine, not part of the tuned run
    config = TrainConfig.from_dict({**best.user_attrs["config"], "out": str(out), "threads": None, "progress": True})
    return best, config


def write_best(study, out_dir: str | Path, metric: str) -> Path | None:
    """Write `out_dir/best.yaml`: the best trial's whole config (its seed, its data: a threshold view
    when it tuned the threshold), training into `out_dir/best`. None when no trial completed."""
    out_dir = Path(out_dir)
    best, config = best_config(study, out_dir / "best")
    if best is None:
        return None
    header = (f"# The best trial of study {study.study_name!r}: trial {best.number}, {metric} {best.value:.6f}.\n"
              f"# `ctrflow train --config best.yaml` trains it again (flags override any field).\n")
    path = out_dir / "best.yaml"
    _write_atomic(path, header + to_yaml(config))
    return path


def trial_rows(study, metric: str) -> list[dict[str, Any]]:
    """One row per trial: number, state, params, the metric at each validation, its best, duration, pruned."""
    better = max if DIRECTIONS[metric] == "maximize" else min
    names = sorted({k for t in study.get_trials(deepcopy=False) for k in t.distributions})
    rows = []
    for t in study.get_trials(deepcopy=False):
        values = [t.intermediate_values[k] for k in sorted(t.intermediate_values)]
        seconds = t.user_attrs.get("seconds")
        if seconds is None and t.datetime_start and t.datetime_complete:
            seconds = round((t.datetime_complete - t.datetime_start).total_seconds(), 2)
        row = {"number": t.number, "state": t.state.name, "pruned": t.state.name == "PRUNED",
               metric: t.value if t.value is not None else "",
               f"best_{metric}": better(values) if values else "",
               f"{metric}_per_validation": " ".join(f"{v:.6f}" for v in values),
               "steps": " ".join(str(s) for s in t.user_attrs.get("steps", [])),
               "duration_s": seconds if seconds is not None else "",
               "retry_of": t.user_attrs.get("retry_of", "")}
        row.update({f"param.{k}": t.params.get(k, "") for k in names})
        rows.append(row)
    return rows


def write_trials_csv(study, out_dir: str | Path, metric: str) -> Path:
    """Write `out_dir/trials.csv` (`trial_rows`)."""
    rows = trial_rows(study, metric)
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    path = Path(out_dir) / "trials.csv"
    _write_atomic(path, buffer.getvalue())
    return path


def write_plots(study, out_dir: str | Path) -> dict[str, str]:
    """Optuna's matplotlib plots as `out_dir/plots/<name>.png`; `{name: path or why not}`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever the display
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    directory = Path(out_dir) / "plots"
    directory.mkdir(parents=True, exist_ok=True)
    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    made: dict[str, str] = {}
    for name in PLOTS:
        needed = 2 if name != "optimization_history" else 1
        if len(done) < needed or (name != "optimization_history" and not _varied(done)):
            made[name] = f"skipped: needs {needed} complete trials with varied parameters"
            continue
        try:
            axes = getattr(plots, f"plot_{name}")(study)
        except (ValueError, RuntimeError) as err:  # e.g. importances of parameters that never varied
            made[name] = f"skipped: {err}"
            continue
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
        figure.set_size_inches(10, 6)
        figure.tight_layout()
        path = directory / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        made[name] = str(path)
    return made


def _varied(trials) -> bool:
    return any(len({repr(t.params.get(k)) for t in trials}) > 1 for k in trials[0].params)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary(study, metric: str) -> dict[str, Any]:
    """Counts per state and the best trial's number, value and params."""
    states: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        states[t.state.name] = states.get(t.state.name, 0) + 1
    trials = ranked(study)
    best = trials[0] if trials else None
    return {"states": states, "best_trial": best.number if best else None,
            f"best_{metric}": best.value if best else math.nan, "best_params": dict(best.params) if best else {}}


__all__ = ["PLOTS", "best_config", "drop_checkpoints", "ranked", "summary", "trial_rows", "write_best",
           "write_plots", "write_trials_csv"]
