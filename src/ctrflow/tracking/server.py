"""The tracking server: one long-lived process per user and installation that has imported mlflow,
and forks a worker (`ctrflow.tracking.worker`) for every run a step opens.

Importing mlflow and its SQLite store costs seconds of CPU (its GenAI modules, pandas, sqlalchemy's
mappers and alembic): on a machine whose cores the step keeps busy, that is seconds of wall time for
every command. The server pays it once: a step connects to its Unix socket, and the forked worker,
which shares the imported modules, opens the store, logs the run and exits: tenths of a CPU-second.
The first command of a while starts the server (`ensure_started`) and waits for its imports as it
would for a worker of its own; the server exits after `CTRFLOW_TRACKING_IDLE_SECS` (default 900)
without a connection.

Each connection begins with the step's working directory and environment (a relative
`sqlite:///mlflow.db` and the MLflow variables are the step's, not the server's) and its stderr,
passed as a file descriptor: what mlflow prints reaches the step's terminal. The socket's name
carries a hash of the interpreter, the library's location and version and these modules' files,
so a changed installation starts a server of its own.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import ctrflow
from ctrflow.errors import UserError

IDLE_SECS = 900.0
START_SECS = 300.0  # the imports take seconds on an idle machine, minutes on a crowded one


def socket_path() -> Path:
    """This installation's server socket, in a folder only this user can enter."""
    idle_seconds()  # a bad setting is every step's one-line error, not a server that dies starting
    library = Path(ctrflow.__file__).resolve().parent
    sources = [library / "tracking" / name for name in ("server.py", "worker.py", "mlflow_tracker.py")]
    spec = importlib.util.find_spec("mlflow")
    if spec is not None and spec.origin:
        sources.append(Path(spec.origin))
    key = json.dumps([sys.executable, str(library), ctrflow.__version__, os.environ.get("PYTHONPATH", ""),
                      [os.stat(p).st_mtime_ns for p in sources]])
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"ctrflow-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    if base.stat().st_uid != os.getuid():
        raise UserError(f"{base}: owned by another user; set XDG_RUNTIME_DIR to a folder of your own")
    return base / f"tracking-{hashlib.sha256(key.encode()).hexdigest()[:16]}.sock"


def connect(path: Path) -> socket.socket | None:
    """A connection to the server at `path`, introduced with this process's directory, environment
    and stderr; None when no server listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError as err:
        sock.close()
        if err.errno in (errno.ENOENT, errno.ECONNREFUSED):
            return None
        raise
    hello = json.dumps({"cwd": os.getcwd(), "env": dict(os.environ)}).encode() + b"\n"
    try:
        socket.send_fds(sock, [hello], [2])
    except OSError:  # no stderr to share: what mlflow prints is dropped
        sock.sendall(hello)
    return sock


def ensure_started(path: Path) -> int | None:
    """Start a server at `path` unless one runs or is starting; returns the new server's pid (None
    when another process's server holds the lock). Returns once the server has forked away, before
    its imports."""
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:  # held by a running or starting server for as long as it lives
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        library = str(Path(ctrflow.__file__).resolve().parents[1])  # the server imports this same ctrflow
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [library, os.environ.get("PYTHONPATH")]))}
        with open(path.with_suffix(".log"), "ab") as log:
            launched = subprocess.run([sys.executable, "-m", "ctrflow.tracking.server", str(path), str(lock)],
                                      env=env, cwd="/", pass_fds=(lock,), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=log, check=True)
        return int(launched.stdout)
    finally:
        os.close(lock)  # the server holds the lock on its own copy


def idle_seconds() -> float:
    """How long a server waits for a step before it exits: `CTRFLOW_TRACKING_IDLE_SECS`, else 900."""
    value = os.environ.get("CTRFLOW_TRACKING_IDLE_SECS", str(IDLE_SECS))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UserError(f"CTRFLOW_TRACKING_IDLE_SECS={value!r}: give a number of seconds above 0")
    return seconds


def wait_connected(path: Path, pid: int | None) -> socket.socket:
    """Connect to the server at `path`, starting one if none listens, and waiting while it imports."""
    deadline = time.monotonic() + START_SECS
    retried = False
    while True:
        sock = connect(path)
        if sock is not None:
            return sock
        if pid is not None and not alive(pid):  # gone: stopped since it was started, or failed to start
            if retried:
                log = path.with_suffix(".log")
                last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise UserError(f"the MLflow tracking server exited while starting: {last} (log: {log})")
            retried, pid = True, None
        if pid is None:
            pid = ensure_started(path)
        if time.monotonic() > deadline:
            raise UserError(f"the MLflow tracking server did not start within {START_SECS:.0f} s (log: {path.with_suffix('.log')})")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (one that exited unreaped reads as state Z)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def serve(path: Path, lock: int) -> None:
    """Import mlflow, listen at `path`, fork a worker per connection; return after the idle time.
    `lock` (an open descriptor holding the start lock) stays open in this process only."""
    from ctrflow.tracking import worker

    gc.disable()  # the imports make millions of objects and no garbage: collecting them costs ~20% of their CPU
    worker.preload()
    gc.freeze()  # the workers share the imported modules' pages instead of touching them in every collection
    gc.enable()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the finished workers
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = path.with_name(f"{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    listener.bind(str(staging))
    listener.listen(64)
    os.replace(staging, path)  # a whole socket appears at once
    mine = path.stat().st_ino
    idle = idle_seconds()
    listener.settimeout(min(idle, 30.0))
    last = time.monotonic()
    while True:
        try:
            fork_worker(listener.accept()[0], listener, lock)
            last = time.monotonic()
        except TimeoutError:
            if not owns(path, mine) or time.monotonic() - last > idle:
                break
    if owns(path, mine):
        path.unlink()  # no new step connects from here on
    listener.setblocking(False)
    while True:  # a step that connected while the server decided to stop is still served
        try:
            fork_worker(listener.accept()[0], listener, lock)
        except BlockingIOError:
            break
    listener.close()


def owns(path: Path, inode: int) -> bool:
    """Whether the socket at `path` is still this server's (its file was not removed or replaced)."""
    try:
        return path.stat().st_ino == inode
    except FileNotFoundError:
        return False


def fork_worker(conn: socket.socket, listener: socket.socket, lock: int) -> None:
    """Serve `conn` in a forked worker (`ctrflow.tracking.worker.serve_connection`)."""
    from ctrflow.tracking import worker

    if os.fork() == 0:
        listener.close()
        os.close(lock)  # a run's worker may outlive the server: it must not keep others from starting one
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        code = 1
        try:
            code = worker.serve_connection(conn)
        except BaseException:
            traceback.print_exc()  # to the step's stderr once introduced, else to the server's log
        finally:
            sys.stderr.flush()
            os._exit(code)
    conn.close()


def main() -> None:
    """`python -m ctrflow.tracking.server SOCKET LOCK_FD`: detach, print the server's pid, and serve."""
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        os._exit(0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the launching step reads our pid until this pipe closes
    os.setsid()  # Ctrl-C in the step's terminal reaches the step, which closes its run as FAILED
    serve(Path(sys.argv[1]), int(sys.argv[2]))
    sys.stderr.flush()
    os._exit(0)  # skip the teardown of mlflow's modules


if __name__ == "__main__":
    main()
