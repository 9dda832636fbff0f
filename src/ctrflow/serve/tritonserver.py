"""Start and stop a real `tritonserver` (the one bundled in nvidia-pytriton) on 127.0.0.1.

The serving venv (`scripts/setup_triton.sh`) holds the binary, the python backend, one backend stub
per Python version and the packages a repository's python models import. The server gets a backend
directory of its own with the stub that matches the venv's Python, loopback ports (free ones unless
given), no metrics port and a shared-memory prefix of its own, so several servers can run side by
side. Used by `ctrflow serve`, the integration tests and `benchmarks/serve_latency.py`.
That binary has the python backend only: it serves `ctrflow export --backend python` repositories;
onnxruntime and pytorch ones need a full Triton build (docker/).

New versions without downtime: with `poll_secs` the server runs in Triton's poll mode
(`--model-control-mode=poll --repository-poll-secs=N`) and reloads every model whose folder changed.
`ctrflow export --base` writes a version so that every state a poll can see is servable (the two
new version folders appear first, each in one rename; the ensemble's pin to them last,
`ctrflow.export.versions`), and Triton keeps serving a model until its reloaded copy is ready, so
the ensemble switches from one consistent preprocess+model pair to the next between two requests.
Poll mode rather than explicit loading: the exporter needs no address of the servers (several may
serve one shared repository), and a server restarted later starts from the same files.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[3]  # the source checkout, for an editable install
VENV_ENV = "CTRFLOW_TRITON_VENV"
VENV_NAME = ".venv-triton"  # where scripts/setup_triton.sh puts it by default


def find_serving_venv() -> Path | None:
    """The serving venv: `$CTRFLOW_TRITON_VENV` when set, else `.venv-triton` in the current
    directory or in ctrflow's checkout; None when none holds the tritonserver binary."""
    if os.environ.get(VENV_ENV):
        candidates = [Path(os.environ[VENV_ENV])]
    else:
        candidates = [Path.cwd() / VENV_NAME, CHECKOUT / VENV_NAME]
    return next((venv for venv in candidates if pytriton_root(venv) is not None), None)


def pytriton_root(venv: Path) -> Path | None:
    """`site-packages/pytriton` of `venv` when it holds the tritonserver binary."""
    for root in sorted(venv.glob("lib/python3.*/site-packages/pytriton")):
        if (root / "tritonserver" / "bin" / "tritonserver").exists():
            return root
    return None


def free_port() -> int:
    """A TCP port nobody listens on at the moment (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def python_libdir(venv: Path) -> str | None:
    """The directory of the venv's own `libpython3.X.so.1.0`, None when its Python is static.

    The stub links `libpython3.X.so.1.0` by name; without this it may load the system's copy of
    another patch release, whose symbols the venv's stdlib extensions (e.g. `_ssl`) do not find.
    """
    query = "import sysconfig as s; print(s.get_config_var('LIBDIR') or '', s.get_config_var('INSTSONAME') or '')"
    found = subprocess.run([str(venv / "bin" / "python"), "-c", query], capture_output=True, text=True, check=True)
    libdir, soname = (found.stdout.split() + ["", ""])[:2]
    return libdir if libdir and soname and (Path(libdir) / soname).exists() else None


def prepare_backends(root: Path, workdir: Path) -> Path:
    """`workdir/backends/python` = the python backend + the stub built for the venv's Python."""
    python_version = root.parents[1].name.removeprefix("python")  # lib/python3.11/site-packages
    stub = root / "tritonserver" / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub.exists():
        raise FileNotFoundError(f"no python backend stub for Python {python_version} at {stub}")
    backend = workdir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for item in (root / "tritonserver" / "backends" / "python").iterdir():
        if item.is_file():
            shutil.copy2(item, backend / item.name)
    shutil.copy2(stub, backend / stub.name)
    return backend.parent


class TritonServer:
    """One `tritonserver` process serving `repository` on 127.0.0.1 (CPU, python backend).

    A context manager: entering starts it and waits until it is ready, leaving stops it by PID.
    `url` is `host:port` of its HTTP endpoint; `log()` is what it printed so far.
    """

    def __init__(self, repository: Path, venv: Path, workdir: Path, threads: int = 1,
                 http_port: int | None = None, grpc_port: int | None = None, poll_secs: int | None = None) -> None:
        self.repository = Path(repository).resolve()
        self.venv = Path(venv)
        self.workdir = Path(workdir)
        self.threads = threads
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.url = f"127.0.0.1:{self.http_port}"
        self.process: subprocess.Popen | None = None
        self.log_path = self.workdir / "tritonserver.log"
        self.shm_prefix = f"ctrflow_{os.getpid()}_{self.http_port}"
        self.poll_secs = poll_secs  # None or 0: the repository is read once, at start

    def command(self, backends: Path, binary: Path) -> list[str]:
        """The tritonserver command line: loopback only, no metrics, own shared-memory names, and
        the repository polled every `poll_secs` when set."""
        polling = ["--model-control-mode=poll", f"--repository-poll-secs={self.poll_secs}"] if self.poll_secs else []
        return [str(binary), *polling, f"--model-repository={self.repository}", f"--backend-directory={backends}",
                "--http-address=127.0.0.1", f"--http-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                "--allow-metrics=false", "--exit-on-error=true", "--strict-readiness=true",
                "--exit-timeout-secs=5",  # idle keep-alive connections would hold a SIGINT 30 s
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                "--backend-config=python,shm-default-byte-size=4194304",  # 4 MB, grows on demand
                "--backend-config=python,shm-growth-byte-size=1048576",
                "--backend-config=python,stub-timeout-seconds=120"]

    def environment(self, root: Path) -> dict[str, str]:
        """The server's env: the venv's libpython and the bundled libraries, the venv's python
        first on PATH, few threads."""
        env = dict(os.environ)
        libs = [python_libdir(self.venv), env.get("LD_LIBRARY_PATH"), str(root.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(self.threads)
        return env

    def start(self, timeout: float = 180.0) -> None:
        """Launch the server and wait until `/v2/health/ready`; raises with its log when it dies."""
        root = pytriton_root(self.venv)
        if root is None:
            raise FileNotFoundError(f"no nvidia-pytriton in {self.venv}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        backends = prepare_backends(root, self.workdir)
        binary = root / "tritonserver" / "bin" / "tritonserver"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(backends, binary), stdout=log,
                                            stderr=subprocess.STDOUT, env=self.environment(root),
                                            start_new_session=True)
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Poll readiness every 0.25 s until `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()  # only cleans up: it has exited
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def is_ready(self) -> bool:
        """True when the server answers ready (every model loaded)."""
        try:
            with urllib.request.urlopen(f"http://{self.url}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def is_alive(self) -> bool:
        """True while the server process runs."""
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float = 30.0) -> None:
        """SIGINT (graceful: models unload, stubs exit), then SIGKILL to its process group;
        its shared-memory regions go too."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: only its stubs
                self.process.wait(10)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):  # left behind by a killed stub
            region.unlink(missing_ok=True)

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
