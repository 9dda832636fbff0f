"""`ctrflow train` on several nodes as a Kubeflow Trainer v2 TrainJob, through the kubeflow SDK's
`TrainerClient` on the `torch-distributed` runtime.

On a cluster (the Kubernetes backend) the TrainJob's nodes are pods of the training image; on a
machine with Docker or podman (the SDK's container backend) they are containers of the image on a
network of the job's own, node 0 the rendezvous master. Either way every node runs torchrun (one
process per GPU, one on CPU) and torchrun runs `ctrflow train` (`train_on_node`); the data and the
checkpoint folder must be on storage every node mounts: on a cluster, what the runtime mounts; with
the container backend, the job's folder (`job_folder`), mounted at /workspace in every node.

The call waits for the job, printing node 0's log as it comes; a job that fails, or is deleted,
raises an error naming the job, with the last lines of its log.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Callable

from ctrflow.errors import UserError

BACKENDS = ("kubernetes", "container")
RUNTIME = "torch-distributed"
WORKSPACE = "/workspace"  # where the container backend mounts the job's folder in every node
LAST_LINES = 40  # torchrun's own failure summary takes about 20


def train_on_node(argv: list[str]) -> None:
    """What every process of the job runs: `ctrflow train ARGV` (torchrun set RANK, WORLD_SIZE and
    the rendezvous). The SDK ships this function's source to the nodes, so it imports inside."""
    import sys

    from ctrflow.cli import main

    code = main(["train", *argv])
    if code:
        sys.exit(code)


def job_folder(name: str) -> Path:
    """The host folder the container backend mounts at /workspace in every node of job `name`."""
    return Path.home() / ".kubeflow" / "trainer" / "containers" / name


def trainer_client(backend: str, namespace: str | None = None):
    """The SDK's TrainerClient for `backend`: the cluster of the current kubeconfig, or the Docker
    API at $DOCKER_HOST (podman's included) with the SDK's built-in runtimes."""
    try:
        from kubeflow.trainer import TrainerClient
    except ImportError:
        raise UserError("training on several nodes needs the kubeflow SDK: pip install 'ctrflow[kubeflow]'") from None
    if backend == "kubernetes":
        from kubeflow.common.types import KubernetesBackendConfig

        try:
            return TrainerClient(KubernetesBackendConfig(**({"namespace": namespace} if namespace else {})))
        except Exception as err:  # noqa: BLE001  no kubeconfig, no in-cluster account: several kinds
            raise UserError(f"no Kubernetes cluster to run the TrainJob on ({str(err).splitlines()[0]}); "
                            "--backend container runs it on this machine") from None
    from kubeflow.trainer.backends.container.types import ContainerBackendConfig, TrainingRuntimeSource

    # no runtime source: the SDK's own torch-distributed (a source would be fetched from GitHub);
    # auto_remove off: deleting a job removes its containers and network but keeps its folder, which
    # holds the data and the checkpoint
    return TrainerClient(ContainerBackendConfig(container_runtime="docker", container_host=os.environ.get("DOCKER_HOST"),
                                                runtime_source=TrainingRuntimeSource(sources=[]),
                                                pull_policy="IfNotPresent", auto_remove=False))


def run_train_job(name: str, train_args: list[str], num_nodes: int, gpus_per_node: int, image: str,
                  backend: str = "kubernetes", namespace: str | None = None, timeout: int = 24 * 3600,
                  echo: Callable[[str], None] = print) -> str:
    """Run `ctrflow train TRAIN_ARGS` as TrainJob `name` on `num_nodes` nodes of `gpus_per_node` GPUs
    (0: one CPU process per node) in `image`, wait for it and return its final status ("Complete")."""
    from ctrflow_pipelines.launch import check_shape
    from kubeflow.trainer import CustomTrainer
    from kubeflow.trainer.options import Name

    check_shape(name, num_nodes, gpus_per_node)
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    client = trainer_client(backend, namespace)
    resources = {"gpu": gpus_per_node} if gpus_per_node else None
    tracking = {"MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]} if os.environ.get("MLFLOW_TRACKING_URI") else {}
    trainer = CustomTrainer(func=train_on_node, func_args={"argv": list(train_args)}, image=image,
                            num_nodes=num_nodes, resources_per_node=resources,
                            env={"PYTHONUNBUFFERED": "1", **tracking})
    client.train(runtime=client.get_runtime(RUNTIME), trainer=trainer, options=[Name(name)])
    try:
        last = follow_logs(client, name, echo)
        status = final_status(client, name, timeout)
        if status != "Complete":
            raise UserError(f"TrainJob {name} {status.lower()}; its last log lines:\n" + "\n".join(last))
        return status
    finally:
        if backend == "container":  # a cluster keeps finished jobs for `kubectl describe`
            delete_quietly(client, name)


def follow_logs(client, name: str, echo: Callable[[str], None]) -> list[str]:
    """Print node 0's log as it comes until the job ends; returns its last lines."""
    last: deque[str] = deque(maxlen=LAST_LINES)
    try:
        for chunk in client.get_job_logs(name, follow=True):
            for line in chunk.rstrip("\n").split("\n"):
                last.append(line)
                echo(line)
    except Exception as err:  # noqa: BLE001  the job deleted under us: its status says what happened
        last.append(f"(log stream ended: {err})")
    return list(last)


def final_status(client, name: str, timeout: int) -> str:
    """The job's status once it is Complete or Failed ("Deleted" when it no longer exists)."""
    try:
        return client.wait_for_job_status(name, status={"Complete", "Failed"}, timeout=timeout).status
    except (RuntimeError, ValueError) as err:
        return "Failed" if "fail" in str(err).lower() else "Deleted"


def delete_quietly(client, name: str) -> None:
    """Remove the job's containers and network (nothing left running after the command)."""
    try:
        client.delete_job(name)
    except Exception:  # noqa: BLE001  already gone
        pass


def configure(sub) -> None:
    """`ctrflow pipeline train-job`: `ctrflow train` on several nodes as a Kubeflow Trainer TrainJob."""
    from ctrflow_components.image import TRAIN_IMAGE

    job = sub.add_parser("train-job", help="run `ctrflow train` on several nodes as a Kubeflow Trainer TrainJob",
                         description="Run `ctrflow train` under torchrun on NUM_NODES nodes as a Kubeflow Trainer v2 "
                                     "TrainJob (torch-distributed runtime), wait for it and print node 0's log; "
                                     "give the train flags after `--`. Data and checkpoint folders must be on "
                                     "storage every node mounts (container backend: /workspace, the job's folder).")
    job.add_argument("--num-nodes", type=int, default=2, help="nodes (default 2)")
    job.add_argument("--gpus-per-node", type=int, default=0, help="0: one CPU process per node (default 0)")
    job.add_argument("--backend", choices=("kubernetes", "container"), default="kubernetes",
                     help="kubernetes: the cluster of the current kubeconfig; container: one container per node "
                          "on this machine's Docker or podman (default kubernetes)")
    job.add_argument("--name", default="ctrflow-train", help="TrainJob name")
    job.add_argument("--image", default=TRAIN_IMAGE, help=f"training image (default: {TRAIN_IMAGE})")
    job.add_argument("--namespace", default=None, help="Kubernetes namespace (kubernetes backend)")
    job.add_argument("train_args", nargs="*", metavar="-- TRAIN_FLAGS",
                     help="`ctrflow train` flags, e.g. -- --data /workspace/data --out /workspace/ckpt")


def run_command(args) -> int:
    """`train-job`: the TrainJob, through a Docker API started for it with the container backend."""
    import contextlib

    from ctrflow_pipelines.engine import docker_api
    from ctrflow_pipelines.launch import check_shape

    check_shape(args.name, args.num_nodes, args.gpus_per_node)  # before any engine starts
    with docker_api() if args.backend == "container" else contextlib.nullcontext():
        status = run_train_job(args.name, args.train_args, args.num_nodes, args.gpus_per_node, args.image,
                               backend=args.backend, namespace=args.namespace)
    print(f"TrainJob {args.name}: {status}")
    return 0
