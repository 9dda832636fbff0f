"""Multi-node training specs for engines that already run torchrun across machines: a Kubeflow
Trainer v2 `TrainJob`, a Training Operator `PyTorchJob` and a Vertex AI `CustomJob`.

Pure functions: image, the `ctrflow train` arguments, nodes and GPUs per node in; the manifest (a
dict ready for YAML/JSON) out. Every node runs the same torchrun command and finds the others
through a c10d rendezvous on the first node, whose address each engine provides in an environment
variable (the Kubernetes engines expand `$(VAR)` in container args; on Vertex AI a shell reads the
first node's host from CLUSTER_SPEC). The training data and the checkpoint folder must be on storage every node sees.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from ctrflow.errors import UserError

KINDS = ("trainjob", "pytorchjob", "vertex")
RDZV_PORT = 29400
SHM = {"name": "dshm", "emptyDir": {"medium": "Memory"}}  # torchrun workers share tensors through /dev/shm
# where each engine publishes the first node's address and port
ENDPOINTS = {"trainjob": "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", "pytorchjob": "$(MASTER_ADDR):$(MASTER_PORT)",
             "vertex": f"${{RDZV_HOST}}:{RDZV_PORT}"}
# Vertex AI describes the cluster in CLUSTER_SPEC; worker pool 0 holds the first node
VERTEX_RDZV_HOST = ("RDZV_HOST=$(python -c \"import json, os; "
                    "print(json.loads(os.environ['CLUSTER_SPEC'])['cluster']['workerpool0'][0].rsplit(':', 1)[0])\")")


def check_shape(name: str, num_nodes: int, gpus_per_node: int) -> None:
    """Refuse a job name Kubernetes would reject, or node/GPU counts below 1/0."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name):
        raise UserError(f"--name {name!r}: use lower-case letters, digits and '-' (at most 63, as Kubernetes wants)")
    if num_nodes < 1:
        raise UserError(f"--num-nodes must be at least 1, got {num_nodes}")
    if gpus_per_node < 0:
        raise UserError(f"--gpus-per-node must be 0 or more, got {gpus_per_node}")


def torchrun_command(train_args: list[str], num_nodes: int, gpus_per_node: int, endpoint: str,
                     job_id: str) -> list[str]:
    """`torchrun ... -m ctrflow train ARGS` for one node of the job (one process per GPU, one on CPU)."""
    return ["torchrun", f"--nnodes={num_nodes}", f"--nproc-per-node={max(gpus_per_node, 1)}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}",
            "--max-restarts=0", "-m", "ctrflow", "train", *train_args]


def gpu_limits(gpus_per_node: int, resource: str = "nvidia.com/gpu") -> dict[str, Any]:
    """Kubernetes resource limits of one node's container (none on CPU)."""
    return {"limits": {resource: gpus_per_node}} if gpus_per_node else {}


def trainjob(name: str, image: str, train_args: list[str], num_nodes: int, gpus_per_node: int,
             runtime: str = "torch-distributed", namespace: str | None = None) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on the `runtime`
    ClusterTrainingRuntime, which injects the PET_* rendezvous variables."""
    check_shape(name, num_nodes, gpus_per_node)
    command = torchrun_command(train_args, num_nodes, gpus_per_node, ENDPOINTS["trainjob"], name)
    trainer = {"image": image, "command": command[:1], "args": command[1:], "numNodes": num_nodes,
               "numProcPerNode": max(gpus_per_node, 1)}
    if gpus_per_node:
        trainer["resourcesPerNode"] = gpu_limits(gpus_per_node)
    # the runtime's "node" job and container get a memory-backed /dev/shm (Trainer >= 2.1's overrides API)
    shm = {"targetJobs": [{"name": "node"}],
           "spec": {"volumes": [SHM],
                    "containers": [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}]}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": runtime},
                     "trainer": trainer, "podTemplateOverrides": [shm]}}


def pytorchjob(name: str, image: str, train_args: list[str], num_nodes: int, gpus_per_node: int,
               namespace: str | None = None) -> dict[str, Any]:
    """A Training Operator PyTorchJob (kubeflow.org/v1): one Master and `num_nodes - 1` Workers, each
    with `gpus_per_node` GPUs and a memory-backed /dev/shm; the operator sets MASTER_ADDR/PORT."""
    check_shape(name, num_nodes, gpus_per_node)
    command = torchrun_command(train_args, num_nodes, gpus_per_node, ENDPOINTS["pytorchjob"], name)
    container = {"name": "pytorch", "image": image, "command": command[:1], "args": command[1:],
                 "resources": gpu_limits(gpus_per_node), "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}

    def replicas(count: int) -> dict[str, Any]:
        return copy.deepcopy({"replicas": count, "restartPolicy": "OnFailure",
                              "template": {"spec": {"containers": [container], "volumes": [SHM]}}})

    specs = {"Master": replicas(1)}
    if num_nodes > 1:
        specs["Worker"] = replicas(num_nodes - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
            "spec": {"nprocPerNode": str(max(gpus_per_node, 1)), "pytorchReplicaSpecs": specs}}


def vertex_custom_job(name: str, image: str, train_args: list[str], num_nodes: int, gpus_per_node: int,
                      machine_type: str = "a3-highgpu-8g", accelerator: str = "NVIDIA_H100_80GB") -> dict[str, Any]:
    """A Vertex AI CustomJob (REST body of projects.locations.customJobs.create): worker pool 0 is the
    chief (replicaCount 1), pool 1 the other `num_nodes - 1` nodes. `gcloud ai custom-jobs create
    --config` takes its `jobSpec`."""
    check_shape(name, num_nodes, gpus_per_node)
    command = torchrun_command(train_args, num_nodes, gpus_per_node, ENDPOINTS["vertex"], name)
    machine = {"machineType": machine_type}
    if gpus_per_node:
        machine.update(acceleratorType=accelerator, acceleratorCount=gpus_per_node)
    # each argument one shell word; only the endpoint is expanded
    words = [part if "${" in part else "'" + part.replace("'", "'\\''") + "'" for part in command]
    script = f"{VERTEX_RDZV_HOST} && exec {' '.join(words)}"
    pool = {"machineSpec": machine, "containerSpec": {"imageUri": image, "command": ["sh", "-c", script]},
            "diskSpec": {"bootDiskType": "pd-ssd", "bootDiskSizeGb": 100}}
    pools = [{**copy.deepcopy(pool), "replicaCount": 1}]
    if num_nodes > 1:
        pools.append({**copy.deepcopy(pool), "replicaCount": num_nodes - 1})
    return {"displayName": name, "jobSpec": {"workerPoolSpecs": pools}}


def launch_spec(kind: str, name: str, image: str, train_args: list[str], num_nodes: int, gpus_per_node: int,
                **options: Any) -> dict[str, Any]:
    """The spec of `kind` (one of KINDS); `options` go to that kind's function."""
    builders = {"trainjob": trainjob, "pytorchjob": pytorchjob, "vertex": vertex_custom_job}
    if kind not in builders:
        raise UserError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    return builders[kind](name, image, train_args, num_nodes, gpus_per_node, **options)
