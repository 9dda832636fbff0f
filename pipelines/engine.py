"""The Docker API that KFP's DockerRunner and Kubeflow Trainer's container backend talk to: a Docker
engine that answers (`$DOCKER_HOST` or its default socket), else a `podman system service` started
for the command on a socket of its own and stopped, by its PID, when the command ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ctrflow.errors import UserError

MISSING = ("no container engine: no Docker engine answers and podman is not installed "
           "(install Docker, or podman: `make podman`)")


def answers(url: str | None) -> bool:
    """Whether a Docker API answers at `url` (None: docker-py's default, `$DOCKER_HOST` or the socket)."""
    import docker

    try:
        client = docker.DockerClient(base_url=url) if url else docker.from_env()
        with contextlib.closing(client):
            return bool(client.ping())
    except Exception:  # docker-py raises several kinds when nothing listens
        return False


def engine_available() -> bool:
    """Whether containers can run here: a Docker engine answers or podman is installed."""
    return shutil.which("podman") is not None or answers(None)


@contextlib.contextmanager
def docker_api(timeout: float = 60.0) -> Iterator[str]:
    """Within: `$DOCKER_HOST` names a Docker API that answers; yields its URL."""
    if answers(None):
        yield os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        return
    podman = shutil.which("podman")
    if podman is None:
        raise UserError(MISSING)
    folder = Path(tempfile.mkdtemp(prefix="ctrflow-podman-"))
    url = f"unix://{folder / 'podman.sock'}"
    with open(folder / "service.log", "wb") as log:
        service = subprocess.Popen([podman, "system", "service", "--time=0", url], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    before = os.environ.get("DOCKER_HOST")
    try:
        wait_until_answering(url, service, folder / "service.log", timeout)
        os.environ["DOCKER_HOST"] = url
        yield url
    finally:
        os.environ.pop("DOCKER_HOST", None) if before is None else os.environ.update(DOCKER_HOST=before)
        service.terminate()
        try:
            service.wait(15)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait()
        shutil.rmtree(folder, ignore_errors=True)


def wait_until_answering(url: str, service: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll `url` until it answers; raises with the service's last words when it dies or stays mute."""
    deadline = time.monotonic() + timeout
    while not answers(url):
        if service.poll() is not None or time.monotonic() > deadline:
            last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"podman system service did not start: {last[0]}")
        time.sleep(0.2)
