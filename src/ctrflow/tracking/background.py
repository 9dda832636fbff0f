"""`Tracker` whose MLflow work runs in a process of its own, beside the step.

Importing mlflow and opening a SQLite store costs seconds of CPU, which a step would otherwise pay
before its first row. The run is logged by a worker forked from the tracking server
(`ctrflow.tracking.server`), which has imported mlflow once for every command of a while.
`ctrflow.cli` connects to it (starting the server if none runs) as soon as a step's flags are parsed
(`prepare_from_args`), so that the store opens while the step imports its own libraries; the step's
`BackgroundTracker` takes the connection over and sends every call as one JSON line. Params, metrics
and tags are sent and the step goes on; an artifact is logged before `log_artifact` returns (the step
may delete the file next); `close` waits until everything sent is logged and the run is ended, so a
command returns only once its run is complete, also when it fails. If the step's process dies
without closing, the worker logs what it received and ends the run FAILED.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Mapping

from ctrflow.errors import UserError
from ctrflow.tracking import server
from ctrflow.tracking.base import Tracker


class BackgroundTracker(Tracker):
    """One MLflow run (new, in `experiment`, nested under `parent_run_id` when given), logged by a
    worker process."""

    def __init__(self, uri: str, experiment: str = "ctrflow", run_name: str | None = None,
                 parent_run_id: str | None = None, tags: Mapping[str, str] | None = None) -> None:
        self.uri = uri
        # a server still importing mlflow is waited for only when a reply is: requests queue meanwhile
        self._conn, self._server = _take_prepared(uri)
        self._pending: list[bytes] = []
        self._sent = 0
        self._buffer = b""
        self._replies: dict[int, dict] = {}
        self._failure: str | None = None  # the first error the worker reported
        self._reported = False
        self._closed = False
        self._started = self._send("start", wait=True, uri=uri, experiment=experiment, run_name=run_name,
                                   parent_run_id=parent_run_id, tags={str(k): str(v) for k, v in (tags or {}).items()})
        self._run_id: str | None = None
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def run_id(self) -> str:
        """The run's id (waits until the worker has created the run)."""
        if self._run_id is None:
            self._run_id = self._wait(self._started)["result"]["run_id"]
        return self._run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values as strings); `None` values are skipped."""
        self._send("log_params", params={str(k): str(v) for k, v in params.items() if v is not None})

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log scalar metrics at `step`, stamped now; non-numbers are refused here, by float()."""
        values = {str(k): float(v) for k, v in metrics.items()}
        self._send("log_metrics", metrics=values, step=step, timestamp_ms=int(time.time() * 1000))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (values as strings)."""
        self._send("set_tags", tags={str(k): str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Attach a file or a directory; returns once it is stored."""
        self._wait(self._send("log_artifact", wait=True, path=str(Path(path).resolve()), artifact_path=artifact_path))

    def register_model(self, name: str, artifact_path: str, **kwargs: Any) -> str:
        """Register `artifact_path` of this run as a new version of model `name` (see
        `MlflowTracker.register_model`); returns the version."""
        return self._wait(self._send("register_model", wait=True, name=name, artifact_path=artifact_path, kwargs=kwargs))["result"]

    def close(self, status: str = "FINISHED") -> None:
        """Wait until everything sent is logged, then end the run with `status`; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wait(self._send("close", wait=True, check=False, status=status), check=False)
        finally:
            if self._conn is not None:
                self._conn.close()
        self._raise_failure()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close("FAILED" if exc_type else "FINISHED")
        except UserError as err:
            if exc_type is None:
                raise
            print(f"ctrflow: {err}", file=sys.stderr)  # the step's own error is the one to report

    def _send(self, op: str, wait: bool = False, check: bool = True, **args: Any) -> int:
        """Hand `op` to the worker (which replies when `wait`, or on error); returns its number."""
        if check:
            self._collect(block=False)
            self._raise_failure()
        self._sent += 1
        self._pending.append((json.dumps({"n": self._sent, "op": op, "wait": wait, **args}) + "\n").encode())
        self._deliver(block=False)
        return self._sent

    def _deliver(self, block: bool) -> None:
        """Send the queued requests once connected (waiting for the server when `block`)."""
        if not self._pending:
            return
        if self._conn is None:
            path, pid = self._server
            try:
                self._conn = server.wait_connected(path, pid) if block else server.connect(path)
            except UserError as err:
                self._failure = self._failure or str(err)
                self._server = (path, None)
            if self._conn is None:
                return
        try:
            self._conn.sendall(b"".join(self._pending))
        except OSError:
            self._failure = self._failure or LOST
        self._pending.clear()

    def _wait(self, n: int, check: bool = True) -> dict:
        """The worker's reply to call `n` (everything sent before it is done by then)."""
        self._deliver(block=True)
        while self._conn is not None and n not in self._replies:
            if not self._collect(block=True) and n not in self._replies:
                self._failure = self._failure or LOST
                break
        if check:
            self._raise_failure()
        return self._replies.pop(n, {})

    def _collect(self, block: bool) -> bool:
        """Read the replies that arrived (blocking for at least one when `block`); False at EOF."""
        if self._conn is None:  # not connected yet: no reply can have come
            return True
        while block or select.select([self._conn], [], [], 0)[0]:
            try:
                chunk = self._conn.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                return False
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            for line in lines:
                reply = json.loads(line)
                if "error" in reply:
                    self._failure = self._failure or reply["error"]
                self._replies[reply["n"]] = reply
            block = False
        return True

    def _raise_failure(self) -> None:
        """Raise the first error the worker reported, once."""
        if self._failure and not self._reported:
            self._reported = True
            raise UserError(f"MLflow tracking ({self.uri}): {self._failure}")


LOST = "the tracking worker ended before the run was closed"

_prepared: dict[str, socket.socket] = {}  # a worker already opening the store at this URI
_starting: dict[Path, int | None] = {}  # a server this process started (its pid), not yet connected to


def prepare(uri: str, experiment: str = "ctrflow") -> None:
    """Have a worker open the store at `uri` now, while the step imports its own libraries; the
    step's `BackgroundTracker` then takes it over. When no server runs, start one and return. A
    worker no tracker took ends, holding no run, when this process exits."""
    if uri in _prepared:
        return
    path = server.socket_path()
    conn = server.connect(path)
    if conn is None:
        _starting[path] = server.ensure_started(path)
        return
    try:
        conn.sendall((json.dumps({"n": 0, "op": "prepare", "wait": False, "uri": uri,
                                  "experiment": experiment}) + "\n").encode())
    except OSError:
        conn.close()
        return
    _prepared[uri] = conn


def prepare_from_args(args) -> None:
    """`prepare` for a step's parsed tracking flags (`add_tracking_flags`), unless this invocation
    logs no run: tracking off, mlflow absent, a torchrun rank other than 0, or a step's sub-action
    (`ctrflow preprocess count|merge|transform|finalize`)."""
    import importlib.util

    from ctrflow.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(getattr(args, "tracking_uri", None))
    if (uri.lower() == "none" or getattr(args, "action", None) or int(os.environ.get("RANK", 0)) != 0
            or importlib.util.find_spec("mlflow") is None):
        return
    prepare(uri, getattr(args, "experiment", None) or "ctrflow")


def _take_prepared(uri: str) -> tuple[socket.socket | None, tuple[Path, int | None]]:
    """A prepared worker's connection for `uri`, else a connection to a new worker if the server
    listens, else None after starting the server; with the server's socket and pid (None: not
    started by this process)."""
    path = server.socket_path()
    conn = _prepared.pop(uri, None) or server.connect(path)
    pid = _starting.pop(path, None)
    if conn is None and pid is None:
        pid = server.ensure_started(path)
    return conn, (path, pid)


def _close_at_exit(ref: weakref.ref) -> None:
    """A tracker never closed (no `with` block) ends FAILED when the interpreter exits, after its logs."""
    tracker = ref()
    if tracker is not None and not tracker._closed:
        try:
            tracker.close("FAILED")
        except UserError as err:
            print(f"ctrflow: {err}", file=sys.stderr)
