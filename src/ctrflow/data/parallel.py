"""Run one pass's tasks on worker processes; results come back in task order.

A `Stage` is a picklable object with `start()` (in the worker: build its state), `handle(task)`
and `finish()` (the worker's state at the end, e.g. its value counts). The number of tasks in
flight is bounded, so memory is set by the block size and the worker count, not the input size.
With one worker everything runs in this process, through the same code.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import queue
import traceback
from typing import Any, Iterable, Iterator, Protocol

from ctrflow.errors import UserError


class Stage(Protocol):
    """What a pass runs in each worker."""

    def start(self) -> None:
        """Build the worker's state (runs in the worker)."""

    def handle(self, task: Any) -> Any:
        """Process one task; the result goes back to the main process."""

    def finish(self) -> Any:
        """The worker's state at the end (e.g. its value counts)."""


def start_context():
    """The multiprocessing context workers start from: fork where there is one (no re-import per worker)."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _work(stage: Stage, tasks, results) -> None:
    try:
        try:
            stage.start()
        except UserError as err:  # e.g. unreadable vocabularies: a one-line error, not a crash
            results.put(("start_error", None, str(err)))
            return
        while (item := tasks.get()) is not None:
            seq, task = item
            try:
                results.put(("result", seq, stage.handle(task)))
            except UserError as err:
                results.put(("user_error", seq, str(err)))
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                results.put(("user_error", seq, f"{err.filename or 'output'}: no space left on device"))
        results.put(("final", None, stage.finish()))
    except BaseException:  # report, never hang the main process
        results.put(("crash", None, traceback.format_exc()))


class StagePool:
    """`with StagePool(stage, workers) as pool: for r in pool.map(tasks): ...; finals = pool.finish()`."""

    def __init__(self, stage: Stage, workers: int, in_flight: int | None = None):
        self.stage = stage
        self.workers = max(1, int(workers))
        self.in_flight = in_flight or 2 * self.workers
        self._procs: list = []
        self._finished = False

    def __enter__(self) -> "StagePool":
        if self.workers == 1:
            self.stage.start()
            return self
        ctx = start_context()
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [ctx.Process(target=_work, args=(self.stage, self._tasks, self._results), daemon=True)
                       for _ in range(self.workers)]
        for proc in self._procs:
            proc.start()
        return self

    def map(self, tasks: Iterable) -> Iterator[Any]:
        """Results of `stage.handle(task)` in task order; a task's UserError is raised at its turn."""
        if self.workers == 1:
            yield from (self.stage.handle(task) for task in tasks)
            return
        done: dict[int, tuple[str, Any]] = {}
        sent = next_seq = 0
        source = iter(tasks)
        exhausted = False
        while True:
            while not exhausted and sent - next_seq < self.in_flight:
                task = next(source, StopIteration)
                if task is StopIteration:
                    exhausted = True
                else:
                    self._tasks.put((sent, task))
                    sent += 1
            if exhausted and next_seq == sent:
                return
            kind, seq, value = self._receive()
            done[seq] = (kind, value)
            while next_seq in done:
                kind, value = done.pop(next_seq)
                if kind == "user_error":
                    raise UserError(value)
                next_seq += 1
                yield value

    def finish(self) -> list[Any]:
        """Every worker's `stage.finish()` result."""
        self._finished = True
        if self.workers == 1:
            return [self.stage.finish()]
        for _ in self._procs:
            self._tasks.put(None)
        finals = [self._receive()[2] for _ in self._procs]
        for proc in self._procs:
            proc.join()
        return finals

    def _receive(self) -> tuple[str, Any, Any]:
        while True:
            try:
                kind, seq, value = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self._procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a preprocessing worker died (exit code {dead[0].exitcode}); "
                                       "out of memory? try fewer --workers or a smaller --chunk-rows") from None
                continue
            if kind == "start_error":
                raise UserError(value)
            if kind == "crash":
                raise RuntimeError(f"a preprocessing worker failed:\n{value}")
            return kind, seq, value

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._procs and not (self._finished and exc_type is None):
            for proc in self._procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in self._procs:
                proc.join(timeout=5)
        for q in (getattr(self, "_tasks", None), getattr(self, "_results", None)):
            if q is not None:
                q.cancel_join_thread()
                q.close()
