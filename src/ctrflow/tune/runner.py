"""`run_trials`: what one tuning worker does — keep P trials of a study running.

It recovers trials interrupted by a tuning process that is gone, then starts trials (`study.ask`
samples every parameter of the space at once; queued retries come first) while fewer than `trials`
are done or running and the budget lasts, feeds each trial's validations to the pruner as its
metrics.jsonl shows them, stops the pruned and tells the study how each ended. Several workers may
run it on one storage at once (a database URL): the counts are the study's.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ctrflow.errors import UserError
from ctrflow.contract.schema import Schema
from ctrflow.tune.results import drop_checkpoints
from ctrflow.tune.space import THRESHOLD
from ctrflow.tune.study import HEARTBEAT_S, Study, recover, remaining, requeue
from ctrflow.tune.tracking import StudyTracking
from ctrflow.tune.trial import TrialProcess, slot_env, slot_threads, trial_config
from ctrflow.tune.view import threshold_view

POLL_S = 0.2  # how often running trials' metrics files are read


@dataclass
class Progress:
    """What one `run_trials` call did."""

    started: list[int] = field(default_factory=list)
    finished: dict[int, str] = field(default_factory=dict)  # number -> COMPLETE | PRUNED | FAIL
    recovered: list[int] = field(default_factory=list)


def run_trials(study: Study, trials: int, parallel: int, budget_s: float | None = None, keep_best: int = 3,
               tracking: StudyTracking | None = None, log: Callable[[str], None] = print) -> Progress:
    """Run trials of `study` until it has `trials` done or running, `parallel` at a time, starting none
    after `budget_s` seconds (those running finish); the checkpoints of all but the best `keep_best`
    are deleted as trials end. Interrupted (SIGINT, SIGTERM, an error), it stops its trials, marks
    them failed and queues them again."""
    tracking = tracking or StudyTracking()
    progress = Progress()
    for t in recover(study):
        progress.recovered.append(t.number)
        tracking.close_run(t.user_attrs.get("mlflow_run_id"), "KILLED")
        log(f"trial {t.number}: interrupted earlier; queued again")
    runner = _Runner(study, parallel, keep_best, tracking, log, progress)
    deadline = time.time() + budget_s if budget_s else float("inf")
    previous = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    try:
        while True:
            while runner.free and time.time() < deadline and remaining(study.optuna, trials) > 0:
                runner.start()
            if not runner.running:
                break
            runner.watch()
            time.sleep(POLL_S)
    except BaseException:
        runner.abandon()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return progress


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class _Runner:
    """The trials one worker runs, their slots and their Optuna handles."""

    def __init__(self, study: Study, parallel: int, keep_best: int, tracking: StudyTracking,
                 log: Callable[[str], None], progress: Progress):
        self.study, self.parallel, self.keep_best = study, parallel, keep_best
        self.tracking, self.log, self.progress = tracking, log, progress
        self.settings = study.settings
        self.gpus = visible_gpus(self.settings.base.device)
        self.threads = slot_threads(parallel, self.gpus)
        self.slots = list(range(parallel))
        self.running: dict[int, tuple[Any, TrialProcess]] = {}  # number -> (optuna trial, process)
        self.rows = Schema.load(self.settings.data).rows["train"]
        self.beat = 0.0
        self.failures = 0

    @property
    def free(self) -> bool:
        """Whether a slot is free."""
        return bool(self.slots)

    def start(self) -> None:
        """Ask the study for a trial and start its process (a trial whose data or config cannot be made
        fails at once)."""
        from optuna.trial import TrialState

        settings = self.settings
        trial = self.study.optuna.ask(settings.space.distributions)
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        values = settings.space.values(trial.params)
        directory = settings.out / "trials" / f"{trial.number:04d}"
        try:
            data = settings.data
            if THRESHOLD in values:
                data = threshold_view(settings.data, values[THRESHOLD], settings.out / "views")
            config = trial_config(settings.base, values, data, directory, self.rows, settings.evals_per_epoch,
                                  self.threads)
        except (UserError, OSError) as err:
            self.study.optuna.tell(trial, state=TrialState.FAIL)
            self._failed(trial.number, str(err))
            return
        slot = self.slots.pop(0)
        trial.set_user_attr("directory", str(directory))
        trial.set_user_attr("config", config.to_dict())
        process = TrialProcess.start(trial.number, directory, config, slot, settings.metric,
                                     slot_env(slot, self.parallel, self.gpus))
        trial.set_user_attr("train_pid", process.process.pid)
        trial.set_user_attr("mlflow_run_id", self.tracking.trial_started(trial.number, values, directory))
        if hasattr(self.study.storage, "record_heartbeat"):
            self.study.storage.record_heartbeat(trial._trial_id)
        self.running[trial.number] = (trial, process)
        self.progress.started.append(trial.number)
        shown = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
        self.log(f"trial {trial.number} started: {shown}")

    def watch(self) -> None:
        """Feed new validations to the pruner; finish trials that ended or were pruned."""
        for number, (trial, process) in list(self.running.items()):
            pruned = False
            for k, step, value in process.new_values():
                trial.report(value, k)
                self.tracking.trial_value(trial.user_attrs.get("mlflow_run_id"), self.settings.metric, value, step)
                if process.poll() is None and trial.should_prune():
                    process.stop()
                    pruned = True
                    break
            if pruned or process.poll() is not None:
                self._finish(trial, process, pruned)
        if time.time() - self.beat > HEARTBEAT_S:
            self.beat = time.time()
            for trial, _ in self.running.values():
                if hasattr(self.study.storage, "record_heartbeat"):
                    self.study.storage.record_heartbeat(trial._trial_id)

    def _finish(self, trial, process: TrialProcess, pruned: bool) -> None:
        from optuna.trial import TrialState

        if not pruned:
            process.new_values()  # the last lines, written just before it exited
        del self.running[trial.number]
        self.slots.append(process.slot)
        trial.set_user_attr("steps", [step for step, _ in process.values])
        trial.set_user_attr("seconds", round(process.seconds, 2))
        if pruned:
            state = TrialState.PRUNED
            self.study.optuna.tell(trial, state=state)
        elif process.poll() == 0 and process.values:
            state = TrialState.COMPLETE
            self.study.optuna.tell(trial, process.values[-1][1])
        else:
            state = TrialState.FAIL
            self.study.optuna.tell(trial, state=state)
        self.progress.finished[trial.number] = state.name
        frozen = self.study.optuna.get_trials(deepcopy=False)[trial.number]
        self.tracking.trial_finished(frozen, self.settings.metric)
        drop_checkpoints(self.study.optuna, self.keep_best)
        seconds = f"{process.seconds:.0f} s"
        metric = self.settings.metric
        if state == TrialState.FAIL:
            self._failed(trial.number, f"exit {process.poll()}: {process.log_tail(1)}")
        elif pruned:
            self.log(f"trial {trial.number} pruned at validation {len(process.values)}: "
                     f"{metric} {process.values[-1][1]:.4f} ({seconds})")
        else:
            self.log(f"trial {trial.number} done: {metric} {process.values[-1][1]:.4f} ({seconds})")

    def _failed(self, number: int, why: str) -> None:
        self.progress.finished[number] = "FAIL"
        self.failures += 1
        self.log(f"trial {number} failed: {why}")
        if self.failures >= 3 and not any(s != "FAIL" for s in self.progress.finished.values()):
            raise UserError(f"the first {self.failures} trials failed; the last: {why} "
                            f"(see {self.settings.out}/trials/{number:04d}/train.log)")

    def abandon(self) -> None:
        """Stop every running trial, mark it failed and queue it again (the study was interrupted)."""
        from optuna.trial import TrialState

        for number, (trial, process) in list(self.running.items()):
            process.stop()
            self.study.optuna.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            requeue(self.study.optuna, self.study.optuna.get_trials(deepcopy=False)[number])
            self.tracking.close_run(trial.user_attrs.get("mlflow_run_id"), "KILLED")
            self.log(f"trial {number}: interrupted; queued again")
        self.running.clear()


def visible_gpus(device: str) -> list[str]:
    """The GPUs trials may split (`CUDA_VISIBLE_DEVICES`' entries, else every one torch sees); none
    with `device: cpu`."""
    if device == "cpu":
        return []
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        return []
    if count == 0:
        return []
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


__all__ = ["POLL_S", "Progress", "run_trials", "visible_gpus"]
