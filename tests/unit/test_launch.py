"""Multi-node training specs (Kubeflow Trainer TrainJob, PyTorchJob, Vertex AI CustomJob): the
fields each engine requires, torchrun's rendezvous arguments, GPUs per node, and the CLI writing them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from ctrflow.cli import main
from ctrflow.errors import UserError

pytest.importorskip("kfp")

from ctrflow_pipelines.launch import launch_spec, pytorchjob, trainjob, vertex_custom_job  # noqa: E402

TRAIN = ["--data", "/mnt/data", "--out", "/mnt/ckpt", "--model", "dlrm"]


def flags(command: list[str]) -> dict[str, str]:
    """torchrun's `--name=value` flags, up to the module it runs."""
    return dict(part[2:].split("=", 1) for part in command[:command.index("-m")] if part.startswith("--"))


def test_pytorchjob_has_master_workers_gpus_and_shm():
    job = pytorchjob("ctr-train", "img:1", TRAIN, num_nodes=4, gpus_per_node=8)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "ctr-train")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in specs.items()} == {"Master": 1, "Worker": 3}
    assert job["spec"]["nprocPerNode"] == "8"
    for replica in specs.values():
        pod = replica["template"]["spec"]
        container = pod["containers"][0]
        assert container["name"] == "pytorch" and container["image"] == "img:1"  # the operator wants "pytorch"
        assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        command = container["command"] + container["args"]
        assert flags(command) == {"nnodes": "4", "nproc-per-node": "8", "rdzv-backend": "c10d",
                                  "rdzv-endpoint": "$(MASTER_ADDR):$(MASTER_PORT)", "rdzv-id": "ctr-train",
                                  "max-restarts": "0"}
        assert command[0] == "torchrun" and command[-len(TRAIN) - 2:] == ["ctrflow", "train", *TRAIN]


def test_single_node_pytorchjob_has_no_workers_and_cpu_asks_no_gpu():
    job = pytorchjob("cpu", "img:1", TRAIN, num_nodes=1, gpus_per_node=0)
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {}
    assert flags(container["command"] + container["args"])["nproc-per-node"] == "1"


def test_trainjob_uses_runtime_nodes_and_resources_per_node():
    job = trainjob("ctr-train", "img:1", TRAIN, num_nodes=2, gpus_per_node=4, namespace="ml")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"] == {"name": "ctr-train", "namespace": "ml"}
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 4}}
    assert flags(trainer["command"] + trainer["args"])["rdzv-endpoint"] == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    assert flags(trainer["command"] + trainer["args"])["nnodes"] == "2"
    # torchrun's workers share tensors through /dev/shm: the node pods get a memory-backed one
    (override,) = job["spec"]["podTemplateOverrides"]
    assert override["targetJobs"] == [{"name": "node"}]
    (volume,) = override["spec"]["volumes"]
    assert volume["emptyDir"] == {"medium": "Memory"}
    (container,) = override["spec"]["containers"]
    assert container["volumeMounts"] == [{"name": volume["name"], "mountPath": "/dev/shm"}]


def test_vertex_job_has_chief_pool_and_replica_count(tmp_path):
    job = vertex_custom_job("ctr-train", "img:1", [*TRAIN[:-1], "it's dlrm"], num_nodes=3, gpus_per_node=8)
    pools = job["jobSpec"]["workerPoolSpecs"]
    assert [p["replicaCount"] for p in pools] == [1, 2]  # pool 0: the chief, pool 1: the others
    for pool in pools:
        assert pool["machineSpec"] == {"machineType": "a3-highgpu-8g", "acceleratorType": "NVIDIA_H100_80GB",
                                       "acceleratorCount": 8}
        assert pool["containerSpec"]["imageUri"] == "img:1"
    # run the shell command with a stand-in torchrun: the rendezvous host comes from CLUSTER_SPEC
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (bin_dir / "torchrun").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    cluster = {"cluster": {"workerpool0": ["chief-0:2222"], "workerpool1": ["w-0:2222", "w-1:2222"]},
               "task": {"type": "workerpool1", "index": 0}}
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CLUSTER_SPEC": json.dumps(cluster)}
    done = subprocess.run(pools[1]["containerSpec"]["command"], env=env, capture_output=True, text=True, check=True)
    args = done.stdout.splitlines()
    assert flags(["torchrun", *args]) == {"nnodes": "3", "nproc-per-node": "8", "rdzv-backend": "c10d",
                                          "rdzv-endpoint": "chief-0:29400", "rdzv-id": "ctr-train", "max-restarts": "0"}
    assert args[-len(TRAIN) - 1:] == ["train", *TRAIN[:-1], "it's dlrm"]


def test_vertex_single_node_cpu_has_one_pool_without_accelerator():
    pools = vertex_custom_job("cpu", "img:1", TRAIN, 1, 0, machine_type="n2-standard-8")["jobSpec"]["workerPoolSpecs"]
    assert len(pools) == 1 and pools[0]["machineSpec"] == {"machineType": "n2-standard-8"}


@pytest.mark.parametrize("kind,name,nodes,gpus,message", [
    ("slurm", "ok", 1, 1, "--kind 'slurm'"), ("trainjob", "Bad_Name", 1, 1, "--name 'Bad_Name'"),
    ("vertex", "ok", 0, 1, "--num-nodes must be at least 1"), ("pytorchjob", "ok", 1, -1, "--gpus-per-node")])
def test_bad_shapes_are_refused(kind, name, nodes, gpus, message):
    with pytest.raises(UserError, match=message):
        launch_spec(kind, name, "img", TRAIN, nodes, gpus)


def test_cli_writes_yaml_and_json(tmp_path):
    out = tmp_path / "job.yaml"
    assert main(["pipeline", "launch-spec", "--kind", "pytorchjob", "--num-nodes", "2", "--gpus-per-node", "2",
                 "--out", str(out), "--", *TRAIN]) == 0
    job = yaml.safe_load(out.read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1 and "&id" not in out.read_text()
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"][-len(TRAIN):] == TRAIN
    out = tmp_path / "job.json"
    assert main(["pipeline", "launch-spec", "--kind", "vertex", "--num-nodes", "2", "--out", str(out), "--", *TRAIN]) == 0
    assert [p["replicaCount"] for p in json.loads(out.read_text())["jobSpec"]["workerPoolSpecs"]] == [1, 1]


def test_train_job_refuses_a_bad_shape_before_starting_anything(capsys):
    assert main(["pipeline", "train-job", "--num-nodes", "0", "--backend", "container", "--", "--data", "d"]) == 2
    assert "--num-nodes must be at least 1" in capsys.readouterr().err


def test_train_job_without_a_cluster_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("kubeflow.trainer")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["pipeline", "train-job", "--num-nodes", "2", "--", "--data", "d", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no Kubernetes cluster to run the TrainJob on" in err and len(err.splitlines()) == 1
