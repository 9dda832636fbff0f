"""Run the passes' tasks on worker processes; results come back in task order.

A `Stage` is a picklable object with `start()` (in the worker: build its state), `handle(task)`
and `finish()` (the worker's state at the end, e.g. its value counts). One `WorkerPool` runs
several stages one after the other on the same processes (forked once, memory warm), so a worker
can keep what one pass made for the next (`worker_index()` says which worker holds it, and `run`'s
`route` sends a task back there). The number of tasks in flight is bounded (per worker), so memory
is set by the block size and the worker count, not the input size. With one worker everything runs
in this process, through the same code.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import multiprocessing as mp
import queue
import traceback
from typing import Any, Callable, Iterable, Iterator, Protocol

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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit


def tune_worker() -> None:
    """Make a worker reuse its memory: a block's arrays are freed and allocated again for the next one,
    and fresh pages cost a fault and zeroing each. glibc keeps freed memory (allocations up to 32 MB,
    and up to 32 MB at the top of its heap) instead of unmapping it (~30 % fewer page faults measured);
    the garbage collector skips the objects inherited from the parent (imports)."""
    gc.freeze()
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _MMAP_THRESHOLD_MAX)
    except (OSError, AttributeError):  # not glibc: its defaults
        pass


_WORKER = [0]  # this process's index in its pool (0 in the main process)
_LEAVING: list = []  # workers of pools closed cleanly, still exiting


def reap() -> None:
    """Wait for the workers of cleanly closed pools to exit (their CPU time then counts as this
    process's children's)."""
    while _LEAVING:
        proc = _LEAVING.pop()
        proc.join(timeout=10)
        if proc.is_alive():  # never seen; a worker must not outlive the run
            proc.terminate()
            proc.join()


def worker_index() -> int:
    """The index of the pool worker running this code (0 when the pool runs in the main process)."""
    return _WORKER[0]


def _work(index: int, tasks, results) -> None:
    _WORKER[0] = index
    stage = None
    try:
        tune_worker()
        while (message := tasks.get()) is not None:
            kind, seq, value = message
            if kind == "stage":
                stage = value
                try:
                    stage.start()
                except UserError as err:  # e.g. unreadable vocabularies: a one-line error, not a crash
                    results.put(("start_error", None, str(err)))
            elif kind == "finish":
                results.put(("final", index, stage.finish()))
            else:
                results.put(_handle(stage, seq, value))
    except BaseException:  # report, never hang the main process
        results.put(("crash", None, traceback.format_exc()))


def _handle(stage: Stage, seq: int, task) -> tuple[str, int, Any]:
    try:
        return "result", seq, stage.handle(task)
    except UserError as err:
        return "user_error", seq, str(err)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        return "user_error", seq, f"{err.filename or 'output'}: no space left on device"


class WorkerPool:
    """`with WorkerPool(workers) as pool: for r in pool.run(stage, tasks): ...; finals = pool.finish()`,
    then the next stage on the same workers."""

    def __init__(self, workers: int, in_flight: int = 2):
        self.workers = max(1, int(workers))
        self.in_flight = in_flight  # tasks sent ahead per worker
        self._procs: list = []
        self._queues: list = []
        self._stage: Stage | None = None
        self._broken = False
        self._finals: dict[int, Any] = {}  # workers' `finish()` results that came in
        self._finishing = False  # the workers were told to finish

    def __enter__(self) -> "WorkerPool":
        if self.workers == 1:
            return self
        ctx = start_context()
        self._queues, self._results = [ctx.Queue() for _ in range(self.workers)], ctx.Queue()
        self._procs = [ctx.Process(target=_work, args=(i, q, self._results), daemon=True)
                       for i, q in enumerate(self._queues)]
        for proc in self._procs:
            proc.start()
        return self

    def run(self, stage: Stage, tasks: Iterable, route: Callable[[Any], int | None] | None = None,
            finish: bool = False) -> Iterator[Any]:
        """Results of `stage.handle(task)` in task order; a task's UserError is raised at its turn.
        `route(task)`: the worker that must run it, or None (the least busy one). `finish`: the workers
        are told to finish once the last task is sent, so that one whose tasks are done finishes while the
        others still work (`finish()` then collects)."""
        if self._broken:
            raise RuntimeError("a run of this pool failed: leave the pool")
        self._stage = stage
        if self.workers == 1:
            stage.start()
            yield from (stage.handle(task) for task in tasks)
            return
        for q in self._queues:
            q.put(("stage", None, stage))
        yield from self._dispatch(tasks, route, finish)

    def _dispatch(self, tasks: Iterable, route, finish: bool) -> Iterator[Any]:
        done: dict[int, tuple[str, Any]] = {}
        owner: dict[int, int] = {}
        busy = [0] * self.workers
        sent = next_seq = 0
        source = iter(tasks)
        pending = next(source, StopIteration)
        while True:
            while pending is not StopIteration:
                target = route(pending) if route else None
                if target is None:
                    target = min(range(self.workers), key=busy.__getitem__)
                if busy[target] >= self.in_flight:
                    break
                self._queues[target].put(("task", sent, pending))
                owner[sent], busy[target], sent = target, busy[target] + 1, sent + 1
                pending = next(source, StopIteration)
            if pending is StopIteration and finish and not self._finishing:
                self._tell_finish()
            if pending is StopIteration and next_seq == sent:
                return
            kind, seq, value = self._receive()
            if kind == "final":
                self._finals[seq] = value
                continue
            busy[owner.pop(seq)] -= 1
            done[seq] = (kind, value)
            while next_seq in done:
                kind, value = done.pop(next_seq)
                if kind == "user_error":
                    self._broken = True  # tasks of this run are still out: the pool cannot run another
                    raise UserError(value)
                next_seq += 1
                yield value

    def finish(self) -> list[Any]:
        """Every worker's `finish()` of the stage last run, in worker order."""
        if self.workers == 1:
            return [self._stage.finish()]
        if not self._finishing:
            self._tell_finish()
        while len(self._finals) < len(self._procs):
            _, index, value = self._receive()  # only finals are left to come
            self._finals[index] = value
        finals, self._finals, self._finishing = self._finals, {}, False
        return [finals[i] for i in range(self.workers)]

    def _tell_finish(self) -> None:
        for q in self._queues:
            q.put(("finish", None, None))
        self._finishing = True

    def _receive(self) -> tuple[str, Any, Any]:
        while True:
            try:
                kind, seq, value = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self._procs if p.exitcode is not None]
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
        if exc_type is None:  # the workers exit (freeing their memory) while this process goes on: `reap`
            for q in self._queues:
                q.put(None)
                q.close()
                q.join_thread()
            if self._procs:
                self._results.close()
            _LEAVING.extend(self._procs)
            return
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=5)
        for q in (*self._queues, getattr(self, "_results", None)):
            if q is not None:
                q.cancel_join_thread()
                q.close()
