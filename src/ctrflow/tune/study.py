"""The study: an Optuna study in a storage URL, its sampler and pruner, and the recovery of trials
whose worker is gone.

`open_study` creates the study or loads it (a study records the settings it was started with and
refuses others: another search space, model, base config or metric is another study). A trial left
RUNNING by a tuning process that is gone is failed and its parameters queued again (`recover`); the
retry names it (`retry_of`) and only the retry counts towards the study's trials (`remaining`).
`ctrflow.tune.runner.run_trials` runs the trials.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctrflow.config import TrainConfig
from ctrflow.errors import UserError
from ctrflow.tune.space import SearchSpace
from ctrflow.tune.trial import DIRECTIONS
from ctrflow.processes import process_alive

SETTINGS_ATTR = "ctrflow.settings"
HEARTBEAT_S = 20  # a worker marks its trials alive this often; one silent for 3x is taken as gone
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "successive-halving", "none")


@dataclass(frozen=True)
class StudySettings:
    """What the trials of a study run: the processed data, the base config (`--config`, `--model`),
    the search space and the metric; trials and data views go under `out`."""

    data: Path
    base: TrainConfig
    space: SearchSpace
    out: Path
    metric: str = "auc"
    evals_per_epoch: int = 4

    def record(self) -> dict[str, Any]:
        """What identifies the study (compared when it is loaded again)."""
        base = {k: v for k, v in self.base.to_dict().items() if k not in ("out", "threads")}
        return json.loads(json.dumps({"data": str(self.data), "space": self.space.describe(), "base": base,
                                      "metric": self.metric, "evals_per_epoch": self.evals_per_epoch}))


@dataclass
class Study:
    """An opened study: Optuna's study, its storage, the settings."""

    optuna: Any  # optuna.Study
    storage: Any
    settings: StudySettings
    name: str
    url: str


def default_storage(out: str | Path) -> str:
    """`sqlite:///OUT/study.db` (absolute)."""
    return f"sqlite:///{Path(out).resolve() / 'study.db'}"


def open_study(settings: StudySettings, storage: str | None = None, name: str = "ctrflow-tune",
               sampler: str = "tpe", pruner: str = "median", trials: int = 16) -> Study:
    """The study `name` in `storage` (default: under `settings.out`), created or loaded."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # heartbeats are recorded by `run_trials` for the trials it runs, not only by `Study.optimize`
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    url = storage or default_storage(settings.out)
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        backend = _storage(url)
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(backend)}
    except Exception as err:  # SQLAlchemy and drivers raise many types for a bad URL or an unreachable server
        raise UserError(f"--storage {url}: cannot open the study storage ({str(err).splitlines()[0]})") from None
    done = existing[name].n_trials if name in existing else 0
    study = optuna.create_study(storage=backend, study_name=name, direction=DIRECTIONS[settings.metric],
                                sampler=_sampler(sampler, settings.base.seed + done, trials),
                                pruner=_pruner(pruner, trials, settings), load_if_exists=True)
    recorded = _current(study.user_attrs.get(SETTINGS_ATTR))
    wanted = settings.record()
    if recorded is None:
        study.set_user_attr(SETTINGS_ATTR, wanted)
    elif recorded != wanted:
        what = [k for k in wanted if recorded.get(k) != wanted[k]]
        raise UserError(f"study {name!r} in {url} was started with another {' and '.join(what)}; "
                        f"continue it with the same settings, or give another --study or --out")
    return Study(study, backend, settings, name, url)


def _current(recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """A recorded study's settings with its base config read as today's config reads it: a study
    recorded by an older ctrflow (every model's fields in `model:`) continues."""
    if recorded is None or "base" not in recorded:
        return recorded
    base = TrainConfig.from_dict(recorded["base"]).to_dict()
    kept = {k: v for k, v in base.items() if k in recorded["base"]}
    return {**recorded, "base": json.loads(json.dumps(kept))}


def _storage(url: str):
    """An RDB storage with heartbeats (stale trials of gone workers are requeued), or Optuna's
    reading of other URLs."""
    import optuna

    if "://" in url and not url.startswith(("redis", "grpc")):
        return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=3 * HEARTBEAT_S,
                                          heartbeat_stale_trial_callback=requeue)
    return url


def _sampler(name: str, seed: int, trials: int):
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # a resumed study seeds with the trials so far: its random start does not repeat the first run's draws
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(4, trials // 3)), constant_liar=True)


def _pruner(name: str, trials: int, settings: StudySettings):
    import optuna

    evals = settings.evals_per_epoch * settings.base.epochs
    if name == "median":  # from the first validation on, once a quarter of the trials (up to 5) finished
        return optuna.pruners.MedianPruner(n_startup_trials=max(1, min(5, trials // 4)), n_warmup_steps=1)
    if name == "successive-halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(2, evals), reduction_factor=2)
    return optuna.pruners.NopPruner()


def requeue(study, trial) -> None:
    """Queue an interrupted trial's parameters again (the retry names it in `retry_of`)."""
    if not any(t.user_attrs.get("retry_of") == trial.number for t in study.get_trials(deepcopy=False)):
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})


def remaining(study, trials: int) -> int:
    """Trials still to start: `trials` less those done or running (an interrupted one, retried, does not count)."""
    from optuna.trial import TrialState

    all_trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in all_trials}
    counted = [t for t in all_trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
               or (t.state == TrialState.FAIL and t.number not in retried)]
    return trials - len(counted)


def recover(study: Study) -> list:
    """Fail and requeue RUNNING trials whose worker is gone: a dead PID on this host, or (other hosts)
    no heartbeat for the grace period. Returns those trials."""
    import optuna
    from optuna.trial import TrialState

    before = {t.number for t in study.optuna.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
    host = socket.gethostname()
    for t in study.optuna.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") == host and pid and pid != os.getpid() and not process_alive(int(pid)):
            study.optuna.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            requeue(study.optuna, t)
    optuna.storages.fail_stale_trials(study.optuna)
    return [t for t in study.optuna.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if t.number not in before]


__all__ = ["HEARTBEAT_S", "PRUNERS", "SAMPLERS", "Study", "StudySettings", "default_storage", "open_study",
           "recover", "remaining", "requeue"]
