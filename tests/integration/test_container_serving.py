"""The serving image's `tritonserver` on an exported python-backend repository: raw rows in over
HTTP, the probabilities `ctrflow predict` gives out (<= 1e-5)."""

from __future__ import annotations

import contextlib
import time
import urllib.request

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.contract.schema import Schema
from ctrflow.serve import raw_inputs
from ctrflow.serve.tritonserver import free_port

from tests.fixtures.containers import docker_host, serve_image  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.containers]  # make test-containers
NAME = "ctr"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """synth -> preprocess -> train a few steps -> export --backend python, tracking off."""
    tmp = tmp_path_factory.mktemp("container-serving")
    steps = [
        ["synth", "--rows", "3000", "--days", "2", "--seed", "3", "--out", str(tmp / "raw")],
        ["preprocess", "--dataset", "criteo", "--train", str(tmp / "raw" / "day_0.tsv"),
         "--valid", str(tmp / "raw" / "day_1.tsv"), "--out", str(tmp / "data"), "--freq-threshold", "2"],
        ["train", "--data", str(tmp / "data"), "--model", "dlrm", "--out", str(tmp / "ckpt"),
         "--max-steps", "20", "--batch-size", "128", "--embedding-dim", "8"],
        ["export", "--checkpoint", str(tmp / "ckpt"), "--data", str(tmp / "data"), "--out", str(tmp / "repo"),
         "--name", NAME, "--backend", "python"],
    ]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_TRACKING_URI", "none")
        for argv in steps:
            assert main(argv) == 0, f"ctrflow {argv[0]} failed"
    schema = Schema.load(tmp / "data")
    return {"tmp": tmp, "raw": tmp / "raw" / "day_1.tsv", "data": tmp / "data", "ckpt": tmp / "ckpt",
            "repo": tmp / "repo", "schema": schema, "fields": raw_inputs(schema)}


@pytest.fixture(scope="module")
def server(exported, serve_image):
    """The image's tritonserver on the repository (mounted read-only), on loopback ports of the host."""
    import docker

    http, grpc = free_port(), free_port()
    with contextlib.closing(docker.from_env()) as client:
        container = client.containers.run(
            serve_image, ["tritonserver", "--model-repository=/models", "--http-address=127.0.0.1",
                          f"--http-port={http}", f"--grpc-port={grpc}", "--grpc-address=127.0.0.1",
                          "--allow-metrics=false", "--exit-on-error=true"],
            detach=True, network_mode="host", shm_size="256m",
            volumes={str(exported["repo"]): {"bind": "/models", "mode": "ro"}})
        try:
            wait_ready(container, f"http://127.0.0.1:{http}/v2/health/ready")
            yield f"127.0.0.1:{http}"
        finally:
            container.remove(force=True)


def wait_ready(container, url: str, timeout: float = 240.0) -> None:
    """Poll `url` until the server answers ready; fails with the container's log when it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        container.reload()
        if container.status == "exited":
            pytest.fail("tritonserver exited:\n" + container.logs().decode(errors="replace")[-4000:])
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail("tritonserver not ready:\n" + container.logs().decode(errors="replace")[-4000:])


def raw_columns(path, fields, count: int) -> dict[str, list[str]]:
    """The first `count` rows of a raw Criteo TSV as text per raw field (after the label column)."""
    table = pd.read_csv(path, sep="\t", header=None, dtype=str, keep_default_na=False, nrows=count)
    return {name: table[k + 1].tolist() for k, name in enumerate(fields)}


def served(url: str, rows: dict[str, list[str]]) -> np.ndarray:
    """The served probabilities of `rows`, in requests of at most the model's max_batch_size rows."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    count = len(next(iter(rows.values())))
    limit = int(client.get_model_config(NAME).get("max_batch_size") or count)
    parts = []
    for start in range(0, count, limit):
        inputs = []
        for name, values in rows.items():
            tensor = httpclient.InferInput(name, [len(values[start:start + limit]), 1], "BYTES")
            tensor.set_data_from_numpy(np.array(values[start:start + limit], dtype=object).reshape(-1, 1))
            inputs.append(tensor)
        reply = client.infer(NAME, inputs, outputs=[httpclient.InferRequestedOutput("probability")])
        parts.append(reply.as_numpy("probability").reshape(-1))
    client.close()
    return np.concatenate(parts)


def test_served_probabilities_equal_ctrflow_predict(exported, server, tmp_path):
    sample = tmp_path / "rows.tsv"
    sample.write_text("".join(exported["raw"].read_text().splitlines(keepends=True)[:500]))
    assert main(["predict", "--checkpoint", str(exported["ckpt"]), "--data", str(exported["data"]),
                 "--input", str(sample), "--out", str(tmp_path / "scores.csv")]) == 0
    offline = pd.read_csv(tmp_path / "scores.csv")["probability"].to_numpy()

    answers = served(server, raw_columns(exported["raw"], exported["fields"], 500))

    assert answers.shape == offline.shape == (500,)
    assert np.max(np.abs(answers - offline)) <= 1e-5
    assert offline.std() > 1e-3  # the rows really score differently
