"""`ctrflow pipeline submit --host` a host without a KFP API: one line, exit 2, no traceback."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("kfp")
from ctrflow.cli import main  # noqa: E402


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


class NotKfp(BaseHTTPRequestHandler):
    """A web server with no KFP API: 404 everywhere."""

    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_an_unreachable_host_is_one_line(capfd):
    host = f"http://127.0.0.1:{closed_port()}"
    assert main(["pipeline", "submit", "--host", host]) == 2
    captured = capfd.readouterr()
    assert captured.err == (f"ctrflow pipeline: error: --host {host}: cannot reach a Kubeflow Pipelines API "
                            f"(GET /apis/v2beta1/healthz: Connection refused)\n")
    assert captured.out == ""


def test_a_host_without_a_kfp_api_is_one_line(capfd):
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotKfp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["pipeline", "submit", "--host", host]) == 2
    finally:
        server.shutdown()
    assert capfd.readouterr().err == (f"ctrflow pipeline: error: --host {host}: GET /apis/v2beta1/healthz answered "
                                      f"HTTP 404: no Kubeflow Pipelines API at this URL\n")
