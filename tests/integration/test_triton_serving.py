"""A real `tritonserver` serves the exported python-backend repository: raw rows in over HTTP,
the same probabilities as `ctrflow predict` out; malformed requests get errors naming the field.

Needs the serving venv (`scripts/setup_triton.sh`, which `make test` runs); skipped without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.serve.tritonserver import TritonServer, find_serving_venv

pytestmark = pytest.mark.integration
RAW_FIELDS = (*DENSE, *SPARSE)
NAME = "ctr"


@pytest.fixture(scope="module")
def serving_venv() -> Path:
    """The serving venv, or a skip saying how to make it (a failure in CI, where `make test` makes it)."""
    venv = find_serving_venv()
    if venv is None:
        reason = "serving venv absent: run scripts/setup_triton.sh (or set CTRFLOW_TRITON_VENV)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return venv


@pytest.fixture(scope="module", autouse=True)
def _no_tracking():
    """This module tests serving, not MLflow: every step runs with tracking off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        yield


@pytest.fixture(scope="module")
def exported(tmp_path_factory, serving_venv) -> dict[str, Path]:
    """synth -> preprocess -> train a few steps -> export --backend python, all through the CLI."""
    tmp = tmp_path_factory.mktemp("serving")
    steps = [
        ["synth", "--rows", "3000", "--days", "2", "--seed", "3", "--out", str(tmp / "raw")],
        ["preprocess", "--train", str(tmp / "raw" / "day_0.tsv"), "--valid", str(tmp / "raw" / "day_1.tsv"),
         "--out", str(tmp / "data"), "--freq-threshold", "2"],
        ["train", "--data", str(tmp / "data"), "--model", "dlrm", "--out", str(tmp / "ckpt"),
         "--max-steps", "20", "--batch-size", "128", "--embedding-dim", "8"],
        ["export", "--checkpoint", str(tmp / "ckpt"), "--data", str(tmp / "data"), "--out", str(tmp / "repo"),
         "--name", NAME, "--backend", "python"],
    ]
    for argv in steps:
        assert main(argv) == 0, f"ctrflow {argv[0]} failed"
    return {"tmp": tmp, "raw": tmp / "raw" / "day_1.tsv", "data": tmp / "data", "ckpt": tmp / "ckpt",
            "repo": tmp / "repo"}


@pytest.fixture(scope="module")
def server(exported, serving_venv):
    """The real server on the exported repository, stopped at the end of the module."""
    with TritonServer(exported["repo"], serving_venv, exported["tmp"] / "server") as running:
        yield running


def raw_rows(path: Path, count: int) -> list[list[str]]:
    """The first `count` rows of a 40-column raw TSV file, as fields I1..C26 (label dropped)."""
    with open(path) as lines:
        return [line.rstrip("\n").split("\t")[1:] for _, line in zip(range(count), lines)]


def request_inputs(rows: list[list[str]], fields=RAW_FIELDS):
    """One BYTES [N, 1] input per field (the empty string = missing)."""
    import tritonclient.http as httpclient

    inputs = []
    for name in fields:
        column = RAW_FIELDS.index(name)
        values = np.array([[row[column].encode()] for row in rows], dtype=object)
        tensor = httpclient.InferInput(name, list(values.shape), "BYTES")
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
    return inputs


def infer(url: str, rows: list[list[str]], fields=RAW_FIELDS) -> np.ndarray:
    """probability [N] for `rows` from the server at `url` (host:port), in requests of at most
    the model's max_batch_size rows."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    try:
        limit = int(client.get_model_config(NAME).get("max_batch_size") or len(rows)) or len(rows)
        parts = []
        for start in range(0, len(rows), limit):
            reply = client.infer(NAME, request_inputs(rows[start:start + limit], fields),
                                 outputs=[httpclient.InferRequestedOutput("probability")])
            parts.append(reply.as_numpy("probability").reshape(-1))
    finally:
        client.close()
    return np.concatenate(parts)


def test_served_probabilities_equal_ctrflow_predict(exported, server, tmp_path):
    rows = raw_rows(exported["raw"], 1000)
    sample = tmp_path / "rows.tsv"
    sample.write_text("".join("0\t" + "\t".join(row) + "\n" for row in rows))
    assert main(["predict", "--checkpoint", str(exported["ckpt"]), "--data", str(exported["data"]),
                 "--input", str(sample), "--out", str(tmp_path / "scores.csv")]) == 0
    offline = pd.read_csv(tmp_path / "scores.csv")["probability"].to_numpy()

    served = infer(server.url, rows)

    assert served.shape == offline.shape == (1000,)
    assert np.max(np.abs(served - offline)) <= 1e-5


def test_malformed_rows_get_an_error_naming_the_field_and_serving_goes_on(exported, server):
    from tritonclient.utils import InferenceServerException

    rows = raw_rows(exported["raw"], 8)
    bad_dense = [list(row) for row in rows]
    bad_dense[3][RAW_FIELDS.index("I5")] = "12x"
    with pytest.raises(InferenceServerException, match="I5"):
        infer(server.url, bad_dense)
    without_c7 = tuple(name for name in RAW_FIELDS if name != "C7")
    with pytest.raises(InferenceServerException, match="C7"):
        infer(server.url, rows, fields=without_c7)

    good = infer(server.url, rows)
    assert good.shape == (8,) and np.all((good > 0) & (good < 1))
    assert server.is_alive()


def test_ctrflow_serve_serves_the_repository_until_sigterm(exported, server, serving_venv):
    from ctrflow.serve.tritonserver import free_port

    command = [sys.executable, "-m", "ctrflow", "serve", "--repo", str(exported["repo"]), "--venv", str(serving_venv),
               "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--timeout", "120"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(process.stdout.readline() or "{}")  # printed once every model is ready
        assert sorted(started.get("models", [])) == [NAME, f"{NAME}_model", f"{NAME}_preprocess"], \
            process.stderr.read() if process.poll() is not None else started
        rows = raw_rows(exported["raw"], 16)
        assert np.array_equal(infer(started["http"], rows), infer(server.url, rows))
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0


ECHO_MODEL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            replies = []
            for request in requests:
                text = pb_utils.get_input_tensor_by_name(request, "text").as_numpy()
                lengths = np.array([[len(v[0])] for v in text], dtype=np.float32)
                replies.append(pb_utils.InferenceResponse([pb_utils.Tensor("length", lengths)]))
            return replies
''')
ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 8
input [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "length" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def test_server_fixture_serves_a_python_model_and_stops(serving_venv, tmp_path):
    import tritonclient.http as httpclient

    (tmp_path / "repo" / "echo" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp_path / "repo" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    server = TritonServer(tmp_path / "repo", serving_venv, tmp_path / "server")
    with server:
        text = httpclient.InferInput("text", [3, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"ab"], [b""], [b"xyz"]], dtype=object))
        client = httpclient.InferenceServerClient(server.url)
        reply = client.infer("echo", [text])
        client.close()
        assert reply.as_numpy("length").reshape(-1).tolist() == [2.0, 0.0, 3.0]
    assert not server.is_alive()
