"""`ctrflow train` as a Kubeflow Trainer TrainJob on two nodes, each a container of the training image
(the kubeflow SDK's container backend through a Docker engine or podman), gloo on the CPU, the
rendezvous over the job's own network: the losses of one process, step by step, and a checkpoint that
resumes on one process. A job that fails names itself and shows its last log lines; one whose node is
killed mid-run leaves the checkpoints written before, and `ctrflow train --resume` on one process
finishes the run from them."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

import pytest

from ctrflow.cli import main
from ctrflow.errors import UserError

from tests.fixtures.containers import docker_host, train_image  # noqa: F401  (fixtures)
from tests.fixtures.ranks import losses
from tests.fixtures.training import write_processed

pytestmark = [pytest.mark.integration, pytest.mark.containers]  # make test-containers
pytest.importorskip("kubeflow.trainer")
STEPS = 12


def train_flags(data: str, out: str) -> list[str]:
    return ["--data", data, "--out", out, "--batch-size", "32", "--max-steps", str(STEPS), "--log-every", "1",
            "--device", "cpu", "--no-progress", "--limit-eval-batches", "1", "--embedding-dim", "4",
            "--sharding", "row", "--checkpoint-every", "6"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home of the test's own: the container backend keeps each job's folder under it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "none")
    return tmp_path / "home"


def test_two_container_nodes_log_the_losses_of_one_process(home, train_image, tmp_path):
    from ctrflow_pipelines.trainjob import WORKSPACE, job_folder, run_train_job

    name = "ctrflow-parity"
    data = write_processed(job_folder(name) / "data", train_rows=640, valid_rows=64, cardinality=30)
    lines = []
    status = run_train_job(name, train_flags(f"{WORKSPACE}/data", f"{WORKSPACE}/ckpt"), num_nodes=2,
                           gpus_per_node=0, image=train_image, backend="container", echo=lines.append)
    assert status == "Complete"
    assert main(["train", *train_flags(str(data), str(tmp_path / "one"))]) == 0
    got, ref = losses(job_folder(name) / "ckpt"), losses(tmp_path / "one")
    assert len(got) == len(ref) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-4
    # a node lost mid-run leaves the checkpoints before it: the 2-node one resumes on one process
    resumed = tmp_path / "resumed"
    assert main(["train", *train_flags(str(data), str(resumed)), "--resume",
                 str(job_folder(name) / "ckpt" / "step_00000006")]) == 0
    assert len(losses(resumed)) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(losses(resumed)[6:], ref[6:])) <= 1e-4
    assert any(re.fullmatch(r"\s*processes\s+2", line) for line in lines), lines[-40:]  # node 0's log, streamed


def test_staged_inputs_are_checked_before_any_engine_starts(home, capsys):
    home.mkdir()
    assert main(["pipeline", "train-job", "--backend", "container", "--stage", "data", "--", "--model", "dlrm"]) == 2
    assert "--stage 'data': give FLAG=PATH" in capsys.readouterr().err
    assert main(["pipeline", "train-job", "--backend", "container", "--stage", f"data={home}/none", "--"]) == 2
    assert f"--stage data={home}/none: no such file or folder" in capsys.readouterr().err
    assert main(["pipeline", "train-job", "--stage", f"data={home}", "--checkpoint-to", "out", "--"]) == 2
    assert "need --volume PVC, mounted here at /mnt/ctrflow" in capsys.readouterr().err  # a cluster: the PVC


def test_a_failing_job_names_itself_and_shows_its_last_lines(home, train_image):
    from ctrflow_pipelines.trainjob import run_train_job

    with pytest.raises(UserError, match=r"TrainJob ctrflow-broken failed(.|\n)*/workspace/missing"):
        run_train_job("ctrflow-broken", ["--data", "/workspace/missing", "--out", "/workspace/ckpt"],
                      num_nodes=2, gpus_per_node=0, image=train_image, backend="container", echo=lambda line: None)


def test_a_node_killed_mid_run_leaves_a_checkpoint_that_one_process_finishes(home, train_image, docker_host):
    import docker

    from ctrflow_pipelines.trainjob import WORKSPACE, job_folder, run_train_job

    name, steps = "ctrflow-killed", 400

    def flags(data: str, out: str) -> list[str]:
        return [*train_flags(data, out), "--max-steps", str(steps), "--epochs", "2", "--checkpoint-every", "2",
                "--keep-checkpoints", "2", "--eval-every", str(steps)]

    data = write_processed(job_folder(name) / "data", train_rows=6400, valid_rows=64, cardinality=30)
    ckpt, failure = job_folder(name) / "ckpt", {}

    def run() -> None:
        try:
            run_train_job(name, flags(f"{WORKSPACE}/data", f"{WORKSPACE}/ckpt"), num_nodes=2, gpus_per_node=0,
                          image=train_image, backend="container", echo=lambda line: None)
        except UserError as err:
            failure["error"] = str(err)

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 300
    while not (ckpt / "latest").exists() and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (ckpt / "latest").exists(), failure
    with contextlib.closing(docker.DockerClient(base_url=docker_host)) as client:
        client.containers.get(f"{name}-node-1").kill()
    job.join(300)
    assert not job.is_alive()
    header, *last = failure["error"].splitlines()
    assert header == f"TrainJob {name} failed; its last log lines:"
    assert len(last) >= 5, last  # node 0's torchrun saying its peer went away
    reached = max(json.loads(line)["step"] for line in (ckpt / "metrics.jsonl").read_text().splitlines())
    assert reached < steps  # killed mid-run
    assert main(["train", *flags(str(data), str(ckpt)), "--resume", str(ckpt)]) == 0
    assert json.loads((ckpt / "metrics.jsonl").read_text().splitlines()[-1])["step"] == steps
