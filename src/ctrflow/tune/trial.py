"""One trial: its config file and its `ctrflow train` process, watched through its metrics.jsonl.

A trial's directory `OUT/trials/<number>/` is the training run's `--out` (checkpoints, metrics.jsonl,
config.json) with `trial.yaml`, the whole config it ran (`ctrflow train --config trial.yaml` is the
command), and `train.log`, its stdout and stderr.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctrflow.config import TrainConfig
from ctrflow.config.files import check_config, merge, nest, to_yaml
from ctrflow.processes import available_cores
from ctrflow.tune.space import THRESHOLD

METRIC_KEYS = {"auc": "auc", "logloss": "valid_logloss"}  # study metric -> metrics.jsonl key
DIRECTIONS = {"auc": "maximize", "logloss": "minimize"}


def trial_config(base: TrainConfig, values: dict[str, Any], data: str | Path, out: str | Path,
                 train_rows: int, evals_per_epoch: int, threads: int | None) -> TrainConfig:
    """`base` with a trial's sampled `values` (dotted keys; `freq_threshold` is the data's, left out),
    reading `data` into `out`, validating `evals_per_epoch` times an epoch."""
    overrides = {k: v for k, v in values.items() if k != THRESHOLD}
    raw = merge(base.to_dict(), check_config(nest(overrides), "search space"))
    steps = epoch_steps(TrainConfig.from_dict(raw), train_rows)
    fixed = {"out": str(out), "data": {"path": str(data)}, "eval_every": max(1, math.ceil(steps / evals_per_epoch)),
             "threads": threads, "progress": False, "resume": None}
    return TrainConfig.from_dict(merge(raw, fixed))


def epoch_steps(config: TrainConfig, train_rows: int) -> int:
    """Steps of one epoch (capped by `limit_train_batches` and by `max_steps`): the span the
    validations are spread over."""
    steps = max(1, train_rows // config.data.batch_for(train_rows))
    if config.data.limit_train_batches:
        steps = min(steps, config.data.limit_train_batches)
    if config.max_steps:
        steps = min(steps, config.max_steps)
    return steps


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the tuning process dies (Linux), so a killed study leaves
    no orphan trials training on."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class TrialProcess:
    """A running `ctrflow train` of one trial, and what its metrics.jsonl said so far."""

    number: int
    directory: Path
    config: TrainConfig
    process: subprocess.Popen
    slot: int  # which share of the threads / GPUs it holds
    metric: str = "auc"
    started: float = field(default_factory=time.time)
    values: list[tuple[int, float]] = field(default_factory=list)  # (training step, metric) per validation
    read_bytes: int = 0
    stopped: bool = False

    @classmethod
    def start(cls, number: int, directory: Path, config: TrainConfig, slot: int, metric: str,
              env: dict[str, str]) -> "TrialProcess":
        """Write `trial.yaml` and start `python -m ctrflow train --config trial.yaml` (no MLflow run of
        its own: the study logs it)."""
        if directory.exists():  # a number is never reused: anything here is an earlier attempt's debris
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        (directory / "trial.yaml").write_text(to_yaml(config))
        command = [sys.executable, "-m", "ctrflow", "train", "--config", str(directory / "trial.yaml"),
                   "--tracking-uri", "none"]
        with open(directory / "train.log", "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **env}, preexec_fn=die_with_parent)
        return cls(number, directory, config, process, slot, metric)

    def new_values(self) -> list[tuple[int, int, float]]:
        """Validations written since the last call: (validation number from 1, training step, value)."""
        path = self.directory / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self.read_bytes)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next call
        self.read_bytes += end
        key = METRIC_KEYS[self.metric]
        found = []
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if key in record and record[key] is not None:
                self.values.append((int(record["step"]), float(record[key])))
                found.append((len(self.values), int(record["step"]), float(record[key])))
        return found

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        return self.process.poll()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after `timeout` s) and wait."""
        self.stopped = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of train.log (why a trial failed)."""
        try:
            text = (self.directory / "train.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    @property
    def seconds(self) -> float:
        """Wall time since it started."""
        return time.time() - self.started


def slot_env(slot: int, parallel: int, gpus: list[str]) -> dict[str, str]:
    """The environment of the trial in `slot` of `parallel`: its share of the GPUs (`CUDA_VISIBLE_DEVICES`;
    slots share a GPU when there are fewer GPUs than slots), and none when there are none."""
    if not gpus:
        return {}
    if len(gpus) >= parallel:
        share = len(gpus) // parallel
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[slot * share:(slot + 1) * share])}
    return {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]}


def slot_threads(parallel: int, gpus: list[str]) -> int | None:
    """CPU threads of each trial: the cores split between the trials (None on GPUs: torch's choice)."""
    if gpus:
        return None
    return max(1, available_cores() // parallel)


__all__ = ["DIRECTIONS", "METRIC_KEYS", "TrialProcess", "die_with_parent", "epoch_steps",
           "slot_env", "slot_threads", "trial_config"]
