"""A step's MLflow run, logged by a child process that starts with the command and ends with its run.

Importing mlflow and opening its store cost seconds of CPU. `prepare_from_args` starts the child
(`ctrflow.tracking.child.main`) as soon as the step's flags are parsed, so that
this work overlaps the step's own imports and work. The step's `ChildTracker` sends every call as
one JSON line on the child's stdin and goes on; the child creates the run with the command's start
time, keeps params, metrics and tags, and logs them in batches (at the end, and every
`FLUSH_SECONDS` of a long step). An artifact is stored, and a model registered, before the call
returns (the step may delete the file next). `close` sends the end time and waits until the child
has logged everything and exited, so a command returns with its run complete, also when it fails.
If the step's process dies without closing, the child logs what it received and ends the run FAILED.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from typing import Any, Mapping

from ctrflow.errors import UserError
from ctrflow.tracking.base import Tracker

FLUSH_SECONDS = 30.0  # a long step's params and metrics reach the store at least this often
LOST = "the tracking process ended before the run was closed"

_started: dict[str, tuple[subprocess.Popen, int]] = {}  # a child opening the store at this URI, its start (ms)


def now_ms() -> int:
    """The time now, in MLflow's unit (ms since the epoch)."""
    return int(time.time() * 1000)


def prepare_from_args(args) -> None:
    """Start the child for a step's parsed tracking flags, unless this invocation logs no run:
    tracking off, mlflow absent, a torchrun rank other than 0, or a step's sub-action
    (`ctrflow preprocess count|merge|transform|finalize`)."""
    import importlib.util

    from ctrflow.tracking import check_server, resolve_tracking_uri

    uri = resolve_tracking_uri(getattr(args, "tracking_uri", None))
    if (uri.lower() == "none" or getattr(args, "action", None) or int(os.environ.get("RANK", 0)) != 0
            or uri in _started or importlib.util.find_spec("mlflow") is None):
        return
    check_server(uri)  # before the step's work: a server that is down fails the command in one line
    main = "from ctrflow.tracking.child import main; main()"  # not `-m`: the package imports this module
    child = subprocess.Popen([sys.executable, "-c", main, uri, getattr(args, "experiment", "ctrflow")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if not _started:
        atexit.register(_end_unused)
    _started[uri] = (child, now_ms())


def _end_unused() -> None:
    """A child no tracker took (the command logged no run) ends with the command."""
    for child, _ in _started.values():
        child.kill()
        child.wait()


def take(uri: str) -> tuple[subprocess.Popen, int] | None:
    """The child started for `uri` and the command's start time, once (None: none was started)."""
    return _started.pop(uri, None)


class ChildTracker(Tracker):
    """One MLflow run (new, in `experiment`, nested under `parent_run_id` when given), logged by
    the child process `child` from `start_ms`."""

    def __init__(self, child: subprocess.Popen, uri: str, experiment: str, run_name: str | None,
                 parent_run_id: str | None, tags: Mapping[str, str], start_ms: int) -> None:
        self.uri, self._child = uri, child
        self._asked = 0  # requests that wait for a reply, sent so far
        self._replies: list[dict] = []
        self._closed = self._reported = False
        self._run_id: str | None = None
        self._send("start", experiment=experiment, run_name=run_name, parent_run_id=parent_run_id,
                   tags={str(k): str(v) for k, v in tags.items()}, start_ms=start_ms)
        self._asked += 1  # its reply, the run's id, is read when needed
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def run_id(self) -> str:
        """The run's id (waits until the child has created the run)."""
        if self._run_id is None:
            self._run_id = self._result(1)
        return self._run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values as strings); `None` values are skipped."""
        self._send("log", params={str(k): str(v) for k, v in params.items() if v is not None})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log scalar metrics at `step`, stamped now; non-numbers are refused here, by float()."""
        self._send("log", metrics={str(k): float(v) for k, v in metrics.items()}, step=int(step or 0),
                   timestamp_ms=now_ms())

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (values as strings)."""
        self._send("log", tags={str(k): str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Attach a file or a directory; returns once it is stored."""
        self._ask("log_artifact", path=os.path.abspath(path), artifact_path=artifact_path)

    def register_model(self, name: str, path: str | os.PathLike, **kwargs: Any) -> str:
        """Register the files of folder `path` as a new version of model `name` (see
        `MlflowTracker.register_model`); returns the version."""
        return self._ask("register_model", name=name, path=os.path.abspath(path), kwargs=kwargs)

    def close(self, status: str = "FINISHED", end_ms: int | None = None) -> None:
        """Log everything sent, end the run with `status` at `end_ms` (default: now), and wait for
        the child to exit; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ask("close", status=status, end_ms=end_ms or now_ms())
        finally:
            self._child.stdin.close()
            self._child.wait()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        except UserError as err:
            if exc_type is None:
                raise
            print(f"ctrflow: {err}", file=sys.stderr)  # the step's own error is the one to report

    def _send(self, op: str, **request: Any) -> None:
        try:
            self._child.stdin.write((json.dumps({"op": op, **request}) + "\n").encode())
            self._child.stdin.flush()
        except (BrokenPipeError, ValueError):  # the child died; its run ends FAILED, `close` reports it
            pass

    def _ask(self, op: str, **request: Any) -> Any:
        """Send a request and wait for its result."""
        self._send(op, **request)
        self._asked += 1
        return self._result(self._asked)

    def _result(self, n: int) -> Any:
        """The result of the `n`-th request that waits for one (replies come in order); the child's
        first error is raised once, as one line."""
        while len(self._replies) < n:
            line = self._child.stdout.readline()
            self._replies.append(json.loads(line) if line else {"error": LOST})
        reply = self._replies[n - 1]
        if "error" in reply and not self._reported:
            self._reported = True
            raise UserError(f"MLflow tracking ({self.uri}): {reply['error']}")
        return reply.get("result")


def _close_at_exit(ref: weakref.ref) -> None:
    """A tracker never closed (no `with` block) ends FAILED when the interpreter exits."""
    tracker = ref()
    if tracker is not None and not tracker._closed:
        try:
            tracker.close("FAILED")
        except UserError as err:
            print(f"ctrflow: {err}", file=sys.stderr)


def serve(uri: str, experiment: str, requests, reply) -> None:
    """The child's side: open the store, then serve `requests` (JSON lines) until `close` or their
    end; `reply(dict)` answers `start`, `log_artifact`, `register_model` and `close`."""
    from ctrflow.tracking.mlflow_tracker import MlflowTracker, open_store

    try:
        open_store(uri, experiment)  # while the step imports its own libraries
    except Exception:  # noqa: BLE001 - `start` meets the same problem and reports it
        pass
    tracker, batch, flushed, failure = None, new_batch(), time.monotonic(), None
    for line in requests:
        request = json.loads(line)
        op, answer = request.pop("op"), {}
        try:
            if op == "start":
                tracker = MlflowTracker(uri, request.pop("experiment"), **request)
                answer["result"] = tracker.run_id
            elif op == "log":
                batch["params"].update(request.get("params", {}))
                batch["tags"].update(request.get("tags", {}))
                batch["metrics"] += [(k, v, request["timestamp_ms"], request["step"])
                                     for k, v in request.get("metrics", {}).items()]
            elif tracker is not None and op == "log_artifact":
                tracker.log_artifact(request["path"], request["artifact_path"])
            elif tracker is not None and op == "register_model":
                answer["result"] = tracker.register_model(request["name"], request["path"], **request["kwargs"])
            elif tracker is not None and op == "close":
                end(tracker, batch, request["status"], request["end_ms"])
            if tracker is not None and op == "log" and time.monotonic() - flushed > FLUSH_SECONDS:
                tracker.log_batch(**batch)
                batch, flushed = new_batch(), time.monotonic()
        except Exception as err:  # noqa: BLE001 - reported to the step, which raises it once
            failure = failure or f"{type(err).__name__}: {err}".splitlines()[0]
        if op != "log":
            reply({**answer, "error": failure} if failure and (op != "start" or tracker is None) else answer)
        if op == "close":
            return
    if tracker is not None:  # the step's process died without closing its run
        end(tracker, batch, "FAILED", None)


def new_batch() -> dict:
    """Params, metrics and tags received and not yet logged."""
    return {"params": {}, "metrics": [], "tags": {}}


def end(tracker, batch: dict, status: str, end_ms: int | None) -> None:
    """Log `batch`, then end the run, also when the batch is refused."""
    try:
        tracker.log_batch(**batch)
    finally:
        tracker.close(status, end_ms=end_ms)


def main() -> None:
    """The child's entry point (arguments: URI EXPERIMENT): serve the step's requests from stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the step, which closes its run KILLED
    # mlflow's imports make millions of objects and no garbage: collecting them costs ~20% of their CPU,
    # and this process ends with the run
    gc.disable()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever mlflow prints goes to the step's stderr, not into the replies

    def reply(answer: dict) -> None:
        replies.write(json.dumps(answer) + "\n")
        replies.flush()

    serve(sys.argv[1], sys.argv[2], iter(sys.stdin.readline, ""), reply)
    sys.stderr.flush()
    os._exit(0)  # skip the teardown of mlflow's modules

