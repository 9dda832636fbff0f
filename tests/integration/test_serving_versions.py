"""A running tritonserver picks up the version `ctrflow export --base` adds, without downtime: a client
sends requests all through the switch from version 1 to 2, every one succeeds and is scored by one
consistent preprocess+model pair, and after the switch the served scores are the new checkpoint's
`ctrflow predict`.

The two versions have unrelated vocabularies (day 1's data preprocessed on its own), so a request
that met the new preprocessing and the old model (or the reverse) would score neither version's
numbers, or be refused for ids outside the old tables.

Needs the serving venv (`scripts/setup_triton.sh`); skipped without it. The server's python models
import the ctrflow the serving venv holds (the checkout it was set up from).
"""

from __future__ import annotations

import threading
import time

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
ROWS = 64
POLL_SECS = 1


@pytest.fixture(scope="module", autouse=True)
def _no_tracking():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        yield


def run(*argv: str) -> None:
    assert main(list(argv)) == 0, f"ctrflow {argv[0]} failed"


@pytest.fixture(scope="module")
def days(tmp_path_factory) -> dict:
    """Two days' data and checkpoints through the CLI, version 1 exported (python backend), and
    `ctrflow predict` of both checkpoints on the rows the client sends."""
    tmp = tmp_path_factory.mktemp("versions")
    run("synth", "--rows", "3000", "--days", "3", "--seed", "5", "--out", str(tmp / "raw"))
    for day in (0, 1):
        data, ckpt = tmp / f"data-{day}", tmp / f"ckpt-{day}"
        run("preprocess", "--train", str(tmp / "raw" / f"day_{day}.tsv"), "--valid", str(tmp / "raw" / "day_2.tsv"),
            "--out", str(data), "--freq-threshold", "2")
        run("train", "--data", str(data), "--model", "dlrm", "--out", str(ckpt), "--max-steps", "20",
            "--batch-size", "128", "--embedding-dim", "8", "--seed", str(day))
    lines = (tmp / "raw" / "day_2.tsv").read_text().splitlines(keepends=True)[:ROWS]
    (tmp / "rows.tsv").write_text("".join(lines))
    scores = []
    for day in (0, 1):
        run("predict", "--checkpoint", str(tmp / f"ckpt-{day}"), "--data", str(tmp / f"data-{day}"),
            "--input", str(tmp / "rows.tsv"), "--out", str(tmp / f"scores-{day}.csv"))
        scores.append(pd.read_csv(tmp / f"scores-{day}.csv")["probability"].to_numpy())
    assert np.abs(scores[0] - scores[1]).max() > 1e-3  # the versions really score differently
    run("export", "--checkpoint", str(tmp / "ckpt-0"), "--data", str(tmp / "data-0"), "--out", str(tmp / "repo"),
        "--name", NAME, "--backend", "python", "--validation-rows", "200")
    schema = Schema.load(tmp / "data-0")
    blocks = list(read_raw_rows(tmp / "rows.tsv", description_of(schema)))
    rows = {name: sum((b.columns[name].to_pylist() for b in blocks), []) for name in raw_inputs(schema)}
    return {"tmp": tmp, "rows": rows, "scores": scores}


def request(url: str, rows: dict[str, list[str]]) -> np.ndarray:
    """probability [N] for `rows`, one request."""
    import tritonclient.http as httpclient

    inputs = []
    for name, values in rows.items():
        tensor = httpclient.InferInput(name, [len(values), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[v.encode()] for v in values], dtype=object))
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(url)
    try:
        return client.infer(NAME, inputs).as_numpy("probability").reshape(-1)
    finally:
        client.close()


def pinned_version(url: str) -> set[int]:
    """The versions the served ensemble's steps are pinned to."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    try:
        steps = client.get_model_config(NAME)["ensemble_scheduling"]["step"]
    finally:
        client.close()
    return {int(step["model_version"]) for step in steps}


class Client(threading.Thread):
    """Sends the rows again and again until stopped; keeps every outcome in order."""

    def __init__(self, url: str, rows: dict):
        super().__init__(daemon=True)
        self.url, self.rows = url, rows
        self.outcomes: list[np.ndarray | Exception] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.outcomes.append(request(self.url, self.rows))
            except Exception as err:  # noqa: BLE001 - a failed request is what the test looks for
                self.outcomes.append(err)

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


def which(scores: np.ndarray, expected: list[np.ndarray]) -> int | None:
    """The version (0, 1) whose `ctrflow predict` these scores are, or None."""
    matches = [k for k, e in enumerate(expected) if np.abs(scores - e).max() <= 1e-5]
    return matches[0] if matches else None


def test_requests_all_succeed_through_the_switch_to_the_next_version(days, serving_venv):
    tmp, expected = days["tmp"], days["scores"]
    with TritonServer(tmp / "repo", serving_venv, tmp / "server", poll_secs=POLL_SECS) as server:
        assert which(request(server.url, days["rows"]), expected) == 0
        client = Client(server.url, days["rows"])
        client.start()
        try:
            time.sleep(2 * POLL_SECS)
            run("export", "--checkpoint", str(tmp / "ckpt-1"), "--data", str(tmp / "data-1"), "--base", str(tmp / "repo"),
                "--name", NAME, "--validation-rows", "200")
            deadline = time.monotonic() + 240
            while pinned_version(server.url) != {2} and time.monotonic() < deadline:
                time.sleep(0.5)
            assert pinned_version(server.url) == {2}, server.log()[-3000:]
            time.sleep(3 * POLL_SECS)  # more requests on the new pair
        finally:
            client.stop()
        log = server.log()
        final = request(server.url, days["rows"])

    failures = [o for o in client.outcomes if isinstance(o, Exception)]
    assert not failures, f"{len(failures)} of {len(client.outcomes)} requests failed, first: {failures[0]}\n{log[-3000:]}"
    versions = [which(o, expected) for o in client.outcomes]
    assert None not in versions, "a request was scored by a mixed preprocess+model pair"
    switch = versions.index(1)
    assert 0 < switch and set(versions[switch:]) == {1}, "served versions went back and forth"
    assert np.abs(final - expected[1]).max() <= 1e-5  # the new checkpoint's `ctrflow predict`
