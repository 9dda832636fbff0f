"""`ctrflow serve --repo DIR [--http-port 8000] [--grpc-port 8001] [--venv DIR] [--poll-secs 5]`: a real tritonserver.

Serves an exported repository on 127.0.0.1 with the `tritonserver` bundled in nvidia-pytriton
(the serving venv, `scripts/setup_triton.sh`) until Ctrl-C or SIGTERM. It polls the repository
every `--poll-secs` seconds (Triton's poll mode): a version that `ctrflow export --base` adds is
loaded and served without downtime (`ctrflow.serve.tritonserver` says how). That binary has the python
backend only, so the repository must come from `ctrflow export --backend python`; onnxruntime and
pytorch repositories serve with the Triton image (docker/).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from ctrflow.errors import UserError


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow serve`."""
    parser.add_argument("--repo", required=True, help="Triton model repository (`ctrflow export --out`)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--venv", default=None,
                        help="serving venv with nvidia-pytriton (default: $CTRFLOW_TRITON_VENV or .venv-triton)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each model instance")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every model to load")
    parser.add_argument("--poll-secs", type=int, default=5,
                        help="seconds between polls of the repository for new versions (0: read it once, at start)")


def check_servable(repo: Path) -> list[str]:
    """The repository's model names; UserError naming the config of a model this binary cannot serve."""
    from ctrflow.export.triton import read_config

    configs = {path: read_config(path) for path in sorted(repo.glob("*/config.pbtxt"))}
    if not configs:
        raise UserError(f"--repo {repo}: no model (no */config.pbtxt)")
    for path, config in configs.items():
        if config.platform != "ensemble" and config.backend != "python":
            raise UserError(f"{path}: backend {config.backend or config.platform} is not in the bundled "
                            f"tritonserver (python backend only); export with --backend python or use docker/")
    return [config.name for config in configs.values()]


def _stop_on_sigterm(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as gracefully as Ctrl-C


def run(args: argparse.Namespace) -> int:
    """Start the server, print one JSON line (URLs, models), serve until interrupted."""
    from ctrflow.serve.tritonserver import TritonServer, find_serving_venv

    repo = Path(args.repo)
    models = check_servable(repo)
    venv = Path(args.venv) if args.venv else find_serving_venv()
    if venv is None:
        raise UserError("no serving venv: run scripts/setup_triton.sh, or pass --venv / set CTRFLOW_TRITON_VENV")
    if args.poll_secs < 0:
        raise UserError(f"--poll-secs must be 0 or more, got {args.poll_secs}")
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="ctrflow-serve-") as workdir:
        server = TritonServer(repo, venv, Path(workdir), threads=args.threads,
                              http_port=args.http_port or None, grpc_port=args.grpc_port or None,
                              poll_secs=args.poll_secs)
        try:  # from here on, every way out stops the server (its own session: nobody else would)
            _start(server, repo, args.timeout)
            print(json.dumps({"http": server.url, "grpc": f"127.0.0.1:{server.grpc_port}",
                              "repository": str(server.repository), "models": models,
                              "poll_secs": args.poll_secs}), flush=True)
            while server.is_alive():
                time.sleep(0.5)
            print(server.log()[-4000:], file=sys.stderr)
            print("ctrflow serve: tritonserver exited on its own", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            server.stop()
            signal.signal(signal.SIGTERM, previous)


def _start(server, repo: Path, timeout: float) -> None:
    try:
        server.start(timeout=timeout)
    except (RuntimeError, TimeoutError, FileNotFoundError) as err:
        print(str(err), file=sys.stderr)  # with the server's log tail
        raise UserError(f"tritonserver did not start on {repo}: {str(err).splitlines()[0]}") from None
