"""A dataset of its own through the whole chain, by the commands a user types: `ctrflow synth
--dataset movielens-like` -> `preprocess --dataset movielens.yaml` -> `train` (each model) ->
`evaluate` -> `export` -> a real `tritonserver` answering the raw CSV rows as `ctrflow predict`
scores them; and the quality bar: one epoch of default training on 200,000 rows recovers at least
0.7 of the teacher's AUC lift over chance."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from ctrflow.cli import main
from ctrflow.models import MODELS

pytestmark = pytest.mark.integration
ROWS = 4000


@pytest.fixture(scope="module", autouse=True)
def _no_tracking():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        yield


def run(*argv: str) -> None:
    """One `ctrflow` command, which must succeed."""
    assert main(list(argv)) == 0, f"ctrflow {' '.join(argv)} failed"


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    """synth -> preprocess -> per model: train a few steps, evaluate, export (python backend) into one
    repository, one ensemble per model."""
    tmp = tmp_path_factory.mktemp("movielens-chain")
    raw, data, repo = tmp / "raw", tmp / "data", tmp / "repo"
    run("synth", "--dataset", "movielens-like", "--rows", str(ROWS), "--days", "2", "--seed", "7", "--out", str(raw))
    run("preprocess", "--dataset", str(raw / "movielens.yaml"), "--train", str(raw / "day_0.csv"),
        "--valid", str(raw / "day_1.csv"), "--out", str(data))
    for model in MODELS:
        ckpt, report = tmp / f"ckpt-{model}", tmp / f"eval-{model}"
        run("train", "--data", str(data), "--model", model, "--out", str(ckpt), "--max-steps", "8",
            "--batch-size", "256", "--embedding-dim", "8", "--no-progress")
        run("evaluate", "--data", str(data), "--checkpoint", str(ckpt), "--out", str(report))
        run("export", "--checkpoint", str(ckpt), "--data", str(data), "--out", str(repo), "--name", f"ml_{model}",
            "--backend", "python", "--metrics", str(report), "--validation-rows", "1000")
    return {"tmp": tmp, "raw": raw, "data": data, "repo": repo}


def test_every_model_trains_evaluates_and_exports_on_the_described_table(chain):
    schema = json.loads((chain["data"] / "schema.json").read_text())
    assert [f["name"] for f in schema["features"]["sparse"]] == ["userId", "movieId", "genres"]
    assert schema["features"]["sparse"][2]["kind"] == "multi_hot" and schema["dataset"]["label"] == "liked"
    for model in MODELS:
        metrics = json.loads((chain["tmp"] / f"eval-{model}" / "metrics.json").read_text())
        assert metrics["rows"] == ROWS and 0.0 < metrics["auc"] < 1.0, model
        config = (chain["repo"] / f"ml_{model}" / "config.pbtxt").read_text()
        assert 'name: "genres"' in config and 'name: "timestamp"' not in config
    assert json.loads((chain["repo"] / "validation.json").read_text())["max_abs_diff"] <= 1e-5


def test_the_server_answers_raw_csv_rows_as_predict_scores_them(chain, tmp_path, serving_venv):
    import tritonclient.http as httpclient

    from ctrflow.serve.tritonserver import TritonServer

    venv = serving_venv
    lines = (chain["raw"] / "day_1.csv").read_text().splitlines()[:301]
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    frame = pd.read_csv(tmp_path / "rows.csv", dtype=str, keep_default_na=False)  # the text of each field
    inputs = []
    for name in ("age", "price", "userId", "movieId", "genres"):
        tensor = httpclient.InferInput(name, [len(frame), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[v.encode()] for v in frame[name]], dtype=object))
        inputs.append(tensor)
    server = TritonServer(chain["repo"], venv, tmp_path / "server")
    server.start(timeout=900)  # eight python models, each importing torch, on a busy 2-core machine
    client = httpclient.InferenceServerClient(server.url)
    try:
        for model in MODELS:
            run("predict", "--checkpoint", str(chain["tmp"] / f"ckpt-{model}"), "--data", str(chain["data"]),
                "--input", str(tmp_path / "rows.csv"), "--out", str(tmp_path / f"{model}.csv"))
            offline = pd.read_csv(tmp_path / f"{model}.csv")["probability"].to_numpy()
            served = client.infer(f"ml_{model}", inputs).as_numpy("probability").reshape(-1)
            assert served.shape == offline.shape == (300,)
            assert np.abs(served - offline).max() <= 1e-5, model
    finally:
        client.close()
        server.stop()


def test_one_epoch_of_default_training_recovers_most_of_the_teacher_lift(tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fastest setting on a busy 2-core machine
    try:
        run("synth", "--dataset", "movielens-like", "--rows", "200000", "--days", "2", "--seed", "0",
            "--out", str(tmp_path / "raw"))
        run("preprocess", "--dataset", str(tmp_path / "raw" / "movielens.yaml"),
            "--train", str(tmp_path / "raw" / "day_0.csv"), "--valid", str(tmp_path / "raw" / "day_1.csv"),
            "--out", str(tmp_path / "data"))
        run("train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "ckpt"), "--no-progress")
    finally:
        torch.set_num_threads(threads)
    teacher = json.loads((tmp_path / "raw" / "synth.json").read_text())["teacher_auc"]["day_1"]
    last = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["auc"] - 0.5 >= 0.7 * (teacher - 0.5), (last["auc"], teacher)
