"""The tracking server imports mlflow once for every command of a while: a run logged through it is
the step's run (its directory, its environment), and the server starts, goes away and is replaced
without a step noticing."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ctrflow.processes import process_alive
from ctrflow.tracking import server

pytestmark = pytest.mark.integration
mlflow = pytest.importorskip("mlflow")

STEP = """
import json
from ctrflow.tracking import make_tracker

with make_tracker("sqlite:///mlflow.db", "srv", "step") as tracker:
    tracker.log_params({"where": "here"})
print(json.dumps({"run_id": tracker.run_id}))
"""


def server_pid(path: Path) -> int:
    """The pid of the process listening at `path` (the socket's peer credentials)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    sock.close()
    return pid


def run_step(cwd: Path, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", STEP], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[-1].split('"')[3]


def wait_gone(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not path.exists()


def test_steps_log_into_their_own_directory_as_their_own_user_through_one_server(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run_a = run_step(first, USER="alice", LOGNAME="alice")
    pid = server_pid(server.socket_path())
    run_b = run_step(second, USER="bob", LOGNAME="bob")
    assert server_pid(server.socket_path()) == pid  # the second step found the server the first one started
    for folder, run_id, user in ((first, run_a, "alice"), (second, run_b, "bob")):
        run = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db").get_run(run_id)  # each step's relative store
        assert run.data.params == {"where": "here"} and run.info.status == "FINISHED"
        assert run.data.tags["mlflow.user"] == user


def test_a_killed_server_is_replaced_by_one_of_the_steps_that_find_it_gone(tmp_path):
    run_step(tmp_path)
    path = server.socket_path()
    os.kill(server_pid(path), signal.SIGKILL)  # its socket file stays behind, refusing connections
    steps = [subprocess.Popen([sys.executable, "-c", STEP], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # both find no server: one starts it, the other waits for it
    run_ids = [step.communicate(timeout=600)[0].splitlines()[-1].split('"')[3] for step in steps]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert [client.get_run(r).info.status for r in run_ids] == ["FINISHED", "FINISHED"]
    assert server.alive(server_pid(path))


def test_an_idle_server_exits_and_removes_its_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("CTRFLOW_TRACKING_IDLE_SECS", "1")
    path = tmp_path / "idle.sock"
    pid = server.ensure_started(path)
    server.wait_connected(path, pid).close()
    assert wait_gone(path, 60)
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_alive(pid)


def test_a_process_whose_server_went_idle_starts_another(tmp_path, monkeypatch):
    from ctrflow.tracking import background, make_tracker

    monkeypatch.setenv("CTRFLOW_TRACKING_IDLE_SECS", "1")
    monkeypatch.setattr(server, "socket_path", lambda: tmp_path / "own.sock")
    store = f"sqlite:///{tmp_path}/mlflow.db"
    background.prepare(store)  # starts the server, as a step's flags do
    for name in ("first", "second"):  # the second run comes after the first server has exited
        with make_tracker(store, "srv", name) as tracker:
            tracker.log_params({"run": name})
        assert wait_gone(tmp_path / "own.sock", 60)
    client = mlflow.MlflowClient(store)
    assert client.get_run(tracker.run_id).data.params == {"run": "second"}


def test_a_bad_idle_setting_is_the_steps_one_line_error_before_it_writes(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ctrflow", "synth", "--rows", "100", "--days", "1", "--out",
                           str(tmp_path / "raw"), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CTRFLOW_TRACKING_IDLE_SECS": "ten"})
    assert done.returncode == 2 and not (tmp_path / "raw").exists()
    assert done.stderr.strip() == ("ctrflow synth: error: CTRFLOW_TRACKING_IDLE_SECS='ten': "
                                   "give a number of seconds above 0")
