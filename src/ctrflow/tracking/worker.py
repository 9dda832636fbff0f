"""A run's worker: forked by the tracking server (`ctrflow.tracking.server`) for each connection of a
step's `ctrflow.tracking.background.BackgroundTracker`.

Reads one JSON request a line, in order: `prepare` (optional: open the store ahead of the
run), `start` (open the run), `log_params`, `log_metrics`,
`set_tags`, `log_artifact`, `register_model`, `close`. Replies with one JSON line, for the requests
that ask (`wait`) and for every error. Anything mlflow prints goes to the step's stderr. At the end
of the connection without `close` (the step's process died), the run ends FAILED after what was
received.
"""

from __future__ import annotations

import json
import os
import socket


def handle(tracker, op: str, request: dict):
    """Do one request on the open run; returns the reply's result."""
    if op == "log_params":
        tracker.log_params(request["params"])
    elif op == "log_metrics":
        tracker.log_metrics(request["metrics"], request["step"], timestamp_ms=request["timestamp_ms"])
    elif op == "set_tags":
        tracker.set_tags(request["tags"])
    elif op == "log_artifact":
        tracker.log_artifact(request["path"], request["artifact_path"])
    elif op == "register_model":
        return tracker.register_model(request["name"], request["artifact_path"], **request["kwargs"])
    else:
        raise ValueError(f"unknown tracking request {op!r}")
    return None


def preload() -> None:
    """Import what a run's logging needs, so that every worker forked after it starts with it."""
    import sqlalchemy.orm
    from mlflow.store.artifact import local_artifact_repo  # noqa: F401 (log_artifact's first call)
    from mlflow.store.model_registry import sqlalchemy_store as registry_store  # noqa: F401
    from mlflow.store.tracking import sqlalchemy_store  # noqa: F401

    import ctrflow.tracking.mlflow_tracker  # noqa: F401

    sqlalchemy.orm.configure_mappers()  # the store's models, configured once instead of in every worker


def serve_connection(conn) -> int:
    """Serve one step's connection (a socket): its introduction, then requests until `close` or
    the end of the connection."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
    lines = read_lines(conn, message)
    hello = next(lines, None)
    if hello is None:  # a probe that only checked that the server listens
        return 0
    hello = json.loads(hello)
    os.chdir(hello["cwd"])  # the step's relative store and artifact paths, and its MLflow settings
    os.environ.clear()
    os.environ.update(hello["env"])
    for fd in fds:  # the step's stderr: what mlflow prints reaches the step's terminal
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return serve(lines, conn.sendall)


def read_lines(conn, buffer: bytes):
    """The lines of a connection, starting with the bytes already received."""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line
        chunk = conn.recv(1 << 16)
        if not chunk:
            return
        buffer += chunk


def serve(lines, reply) -> int:
    """Serve requests (one JSON line each) until `close` or their end; `reply` sends a reply's bytes."""
    tracker, closed = None, False
    for line in lines:
        request = json.loads(line)
        n, op, wait = request.pop("n"), request.pop("op"), request.pop("wait")
        answer: dict = {"n": n}
        try:
            if op == "prepare":  # open the store before the run is asked for
                from mlflow import MlflowClient

                MlflowClient(tracking_uri=request["uri"]).get_experiment_by_name(request["experiment"])
                continue
            if op == "start":
                from ctrflow.tracking.mlflow_tracker import MlflowTracker

                tracker = MlflowTracker(request["uri"], request["experiment"], request["run_name"],
                                        request["parent_run_id"], request["tags"])
                answer["result"] = {"run_id": tracker.run_id}
            elif op == "close":
                if tracker is not None:
                    tracker.close(request["status"])
                closed = True
            elif tracker is None:  # the start failed (and that was reported): no run to log into
                continue
            else:
                answer["result"] = handle(tracker, op, request)
        except Exception as err:  # reported to the step, which raises it; later requests still run
            if op == "prepare":
                continue  # the start meets the same problem and reports it
            answer["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
        if wait or "error" in answer:
            reply((json.dumps(answer) + "\n").encode())
        if closed:
            return 0
    if tracker is not None:
        tracker.close("FAILED")
    return 0
