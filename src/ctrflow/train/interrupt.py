"""Ctrl-C and SIGTERM during training: stop after the step in flight, checkpoint it, say how to resume.

Kubernetes and KFP stop a pod with SIGTERM (then SIGKILL after the grace period, 30 s by
default); a terminal sends SIGINT. Before the first step a signal stops the run at once (nothing
trained, nothing to save). From the first step on it only sets a flag that the loop reads between
steps, so the checkpoint holds the weights, optimizer state and position after a whole step. Under
torchrun every rank gets the signal (torchrun forwards it), but not at the same step: the ranks
reduce their flags over a host-side (gloo) group every `AGREE_EVERY` steps and stop together. A
second signal stops at once, without a checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from ctrflow.errors import UserError

if TYPE_CHECKING:
    from ctrflow.runtime import Runtime

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# N processes compare flags this often: a host-side all-reduce each time, never a device sync
AGREE_EVERY = 10


class Interrupted(UserError):
    """Training stopped on a signal; `exit_code` is the shell's 128 + signal number (130, 143)."""

    label = "stopped"  # the CLI's prefix instead of "error"
    run_status = "KILLED"  # the tracking run's final status

    def __init__(self, signum: int, message: str, quiet: bool = False):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
        self.quiet = quiet  # under torchrun only rank 0 says it: every rank stops the same way


class StopSignals:
    """SIGINT/SIGTERM handlers for one training run (a context manager: the previous handlers
    come back on exit). Before `defer()` a signal raises `Interrupted` where the code stands;
    after it, `requested(step)` tells the loop, between steps, whether to stop."""

    def __init__(self, agree_every: int = AGREE_EVERY):
        self.runtime: Runtime | None = None
        self.agree_every = agree_every
        self.signum: int | None = None
        self.deferring = False
        self.group = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def defer(self, runtime: Runtime) -> None:
        """From now on a signal only sets the flag (called by every process as the steps begin)."""
        self.runtime = runtime
        if runtime.distributed and self.group is None:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # collective: every rank creates it here
        self.deferring = True

    def requested(self, step: int) -> int | None:
        """The signal every process stops on after `step`, else None. N processes: only every
        `agree_every` steps, all at the same step (a collective: every rank must call it)."""
        if not self.runtime.distributed:
            return self.signum
        if step % self.agree_every:
            return None
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item()) or None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.deferring:
            raise Interrupted(signum, f"{name} before the first training step; nothing was saved")
        if self.signum is not None:  # the second signal: stop now, as the default handler would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self.runtime.is_main:
            print(f"ctrflow train: {name}: stopping between steps to save a checkpoint "
                  f"(signal again to stop at once, without one)", file=sys.stderr, flush=True)


def checkpoint_stopped(s, log, done: dict[str, int], signum: int) -> Interrupted:
    """Checkpoint the training session `s` (`ctrflow.train.loop.Session`) at its position after
    the last whole step, unless that step was just saved; returns the `Interrupted` that ends the
    run with how to resume. Collective: every process calls it."""
    from ctrflow import checkpoint

    step_dir = s.out / f"step_{s.step:08d}"
    if done["ckpt"] != s.step:
        log.check_finite(s.step)  # never checkpoint weights a NaN has reached
        step_dir = checkpoint.save_checkpoint(s.out, s.model, s.optimizers,
                                              {"step": s.step, "epoch": s.epoch, "batch": s.batch},
                                              s.config, s.schema, s.runtime)
        done["ckpt"] = s.step
    name = signal.Signals(signum).name
    return Interrupted(signum, f"{name} at step {s.step}; checkpoint {step_dir} written: run the same "
                               f"command with --resume {s.out} to continue", quiet=not s.runtime.is_main)
