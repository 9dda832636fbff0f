"""A real `tritonserver` serves the exported python-backend repository: raw rows in over HTTP, the
same probabilities as `ctrflow predict` out, for the built-in Criteo TSV and for a dataset of its
own (the movielens-like CSV: a header, users, movies, a multi-hot genre list, two numbers);
malformed requests get errors naming the field.

Needs the serving venv (`scripts/setup_triton.sh`, which `make test` runs); skipped without it.
The server's python models import the ctrflow the serving venv holds (the checkout it was set up
from): its embedded Python ignores PYTHONPATH.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.contract.formats.raw import read_raw_rows
from ctrflow.contract.transform import description_of
from ctrflow.contract.schema import Schema
from ctrflow.serve import raw_inputs
from ctrflow.serve.tritonserver import TritonServer

pytestmark = pytest.mark.integration
NAME = "ctr"
DATASETS = {  # synth --dataset, the day files, the description preprocess reads
    "criteo": ("day_0.tsv", "day_1.tsv", "criteo"),
    "movielens-like": ("day_0.csv", "day_1.csv", "movielens.yaml"),
}


@pytest.fixture(scope="module", autouse=True)
def _no_tracking():
    """This module tests serving, not MLflow: every step runs with tracking off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        yield


@pytest.fixture(scope="module", params=list(DATASETS))
def exported(request, tmp_path_factory, serving_venv) -> dict:
    """synth -> preprocess -> train a few steps -> export --backend python, all through the CLI."""
    tmp = tmp_path_factory.mktemp(f"serving-{request.param}")
    train, valid, described = DATASETS[request.param]
    dataset = described if described == "criteo" else str(tmp / "raw" / described)
    steps = [
        ["synth", "--dataset", request.param, "--rows", "3000", "--days", "2", "--seed", "3", "--out", str(tmp / "raw")],
        ["preprocess", "--dataset", dataset, "--train", str(tmp / "raw" / train), "--valid", str(tmp / "raw" / valid),
         "--out", str(tmp / "data"), "--freq-threshold", "2"],
        ["train", "--data", str(tmp / "data"), "--model", "dlrm", "--out", str(tmp / "ckpt"),
         "--max-steps", "20", "--batch-size", "128", "--embedding-dim", "8"],
        ["export", "--checkpoint", str(tmp / "ckpt"), "--data", str(tmp / "data"), "--out", str(tmp / "repo"),
         "--name", NAME, "--backend", "python"],
    ]
    for argv in steps:
        assert main(argv) == 0, f"ctrflow {argv[0]} failed"
    schema = Schema.load(tmp / "data")
    return {"tmp": tmp, "dataset": request.param, "raw": tmp / "raw" / valid, "data": tmp / "data",
            "ckpt": tmp / "ckpt", "repo": tmp / "repo", "schema": schema, "fields": raw_inputs(schema)}


@pytest.fixture(scope="module")
def server(exported, serving_venv):
    """The real server on the exported repository, stopped at the end of the module."""
    with TritonServer(exported["repo"], serving_venv, exported["tmp"] / "server") as running:
        yield running


def raw_rows(exported: dict, count: int) -> dict[str, list[str]]:
    """The first `count` rows of the validation day as a client reads them: text per raw column."""
    blocks = read_raw_rows(exported["raw"], description_of(exported["schema"]))
    rows = {name: [] for name in exported["fields"]}
    for block in blocks:
        for name in rows:
            rows[name] += block.columns[name].to_pylist()
        if len(rows[exported["fields"][0]]) >= count:
            break
    return {name: values[:count] for name, values in rows.items()}


def first_lines(exported: dict, count: int, out: Path) -> Path:
    """A raw file of the first `count` rows of the validation day (and its header, if it has one)."""
    lines = exported["raw"].read_text().splitlines(keepends=True)
    header = 1 if description_of(exported["schema"]).header else 0
    out.write_text("".join(lines[:count + header]))
    return out


def request_inputs(rows: dict[str, list[str]], fields):
    """One BYTES [N, 1] input per field (the empty string = missing)."""
    import tritonclient.http as httpclient

    inputs = []
    for name in fields:
        values = np.array([[value.encode()] for value in rows[name]], dtype=object)
        tensor = httpclient.InferInput(name, list(values.shape), "BYTES")
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
    return inputs


def infer(url: str, rows: dict[str, list[str]], fields) -> np.ndarray:
    """probability [N] for `rows` from the server at `url` (host:port), in requests of at most
    the model's max_batch_size rows."""
    import tritonclient.http as httpclient

    count = len(next(iter(rows.values())))
    client = httpclient.InferenceServerClient(url)
    try:
        limit = int(client.get_model_config(NAME).get("max_batch_size") or count) or count
        parts = []
        for start in range(0, count, limit):
            chunk = {name: values[start:start + limit] for name, values in rows.items()}
            reply = client.infer(NAME, request_inputs(chunk, fields),
                                 outputs=[httpclient.InferRequestedOutput("probability")])
            parts.append(reply.as_numpy("probability").reshape(-1))
    finally:
        client.close()
    return np.concatenate(parts)


def test_served_probabilities_equal_ctrflow_predict(exported, server, tmp_path):
    sample = first_lines(exported, 1000, tmp_path / f"rows{exported['raw'].suffix}")
    assert main(["predict", "--checkpoint", str(exported["ckpt"]), "--data", str(exported["data"]),
                 "--input", str(sample), "--out", str(tmp_path / "scores.csv")]) == 0
    offline = pd.read_csv(tmp_path / "scores.csv")["probability"].to_numpy()

    served = infer(server.url, raw_rows(exported, 1000), exported["fields"])

    assert served.shape == offline.shape == (1000,)
    assert np.max(np.abs(served - offline)) <= 1e-5
    assert offline.std() > 1e-3  # the rows really score differently


def test_malformed_rows_get_an_error_naming_the_field_and_serving_goes_on(exported, server):
    from tritonclient.utils import InferenceServerException

    rows, fields = raw_rows(exported, 8), exported["fields"]
    dense = exported["schema"].features.dense[0].name
    bad_dense = {name: list(values) for name, values in rows.items()}
    bad_dense[dense][3] = "12x"
    with pytest.raises(InferenceServerException, match=dense):
        infer(server.url, bad_dense, fields)
    without_last = fields[:-1]
    with pytest.raises(InferenceServerException, match=fields[-1]):
        infer(server.url, rows, without_last)

    good = infer(server.url, rows, fields)
    assert good.shape == (8,) and np.all((good > 0) & (good < 1))
    assert server.is_alive()


def test_movielens_genres_are_sent_as_the_files_text(exported, server):
    if exported["dataset"] != "movielens-like":
        pytest.skip("the multi-hot column of the movielens-like dataset")
    rows = raw_rows(exported, 64)
    assert any("|" in genres for genres in rows["genres"]) and "" in rows["genres"]  # a list; none listed
    reordered = {name: list(values) for name, values in rows.items()}
    reordered["genres"] = ["|".join(reversed(g.split("|"))) if g else g for g in rows["genres"]]
    # a bag is a set of ids: the order of the genres in the text changes nothing (sum pooling)
    assert np.allclose(infer(server.url, reordered, exported["fields"]),
                       infer(server.url, rows, exported["fields"]), atol=1e-6)


def test_ctrflow_serve_serves_the_repository_until_sigterm(exported, server, serving_venv):
    from ctrflow.serve.tritonserver import free_port

    command = [sys.executable, "-m", "ctrflow", "serve", "--repo", str(exported["repo"]), "--venv", str(serving_venv),
               "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--timeout", "120"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(process.stdout.readline() or "{}")  # printed once every model is ready
        assert sorted(started.get("models", [])) == [NAME, f"{NAME}_model", f"{NAME}_preprocess"], \
            process.stderr.read() if process.poll() is not None else started
        rows = raw_rows(exported, 16)
        assert np.array_equal(infer(started["http"], rows, exported["fields"]),
                              infer(server.url, rows, exported["fields"]))
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
