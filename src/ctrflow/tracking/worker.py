"""The process behind `ctrflow.tracking.background.BackgroundTracker` (`python -m ctrflow.tracking.worker`).

Reads one JSON request a line on stdin, in order: `prepare` (optional: import mlflow and open the store
ahead of the run), `start` (open the run), `log_params`, `log_metrics`,
`set_tags`, `log_artifact`, `register_model`, `close`. Replies on stdout with one JSON line, for the
requests that ask (`wait`) and for every error. Anything mlflow prints goes to stderr. At the end of
stdin without `close` (the step's process died), the run ends FAILED after what was received.
"""

from __future__ import annotations

import gc
import json
import os
import sys


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


def main() -> int:
    """Serve requests until `close` or the end of stdin."""
    # a short-lived process: collecting the millions of objects mlflow's import makes frees nothing
    # and costs ~20% of its CPU
    gc.disable()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # mlflow's own output must not mix with the replies
    tracker, closed = None, False
    for line in sys.stdin:
        request = json.loads(line)
        n, op, wait = request.pop("n"), request.pop("op"), request.pop("wait")
        reply: dict = {"n": n}
        try:
            if op == "prepare":  # import mlflow and open the store before the run is asked for
                from mlflow import MlflowClient

                MlflowClient(tracking_uri=request["uri"]).get_experiment_by_name(request["experiment"])
                continue
            if op == "start":
                from ctrflow.tracking.mlflow_tracker import MlflowTracker

                tracker = MlflowTracker(request["uri"], request["experiment"], request["run_name"],
                                        request["parent_run_id"], request["tags"])
                reply["result"] = {"run_id": tracker.run_id}
            elif op == "close":
                if tracker is not None:
                    tracker.close(request["status"])
                closed = True
            elif tracker is None:  # the start failed (and that was reported): no run to log into
                continue
            else:
                reply["result"] = handle(tracker, op, request)
        except Exception as err:  # reported to the step, which raises it; later requests still run
            if op == "prepare":
                continue  # the start meets the same problem and reports it
            reply["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
        if wait or "error" in reply:
            replies.write(json.dumps(reply) + "\n")
        if closed:
            return 0
    if tracker is not None:
        tracker.close("FAILED")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # everything is stored by now (each call returned once its store committed): skip the interpreter's
    # teardown of mlflow's modules, seconds of CPU after the step is done
    os._exit(code)
