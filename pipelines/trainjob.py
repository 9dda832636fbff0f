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

`run_staged_job` (`--stage`, `--checkpoint-to`; what the pipeline's train task runs) copies inputs
of this machine to that shared storage and the finished checkpoint back: with the container backend
the job's folder; on a cluster a PVC (`--volume`) mounted at /mnt/ctrflow here and in every node.
"""

from __future__ import annotations

import os
import shutil
from collections import deque
from pathlib import Path
from typing import Callable

from ctrflow.errors import UserError

BACKENDS = ("kubernetes", "container")
RUNTIME = "torch-distributed"
WORKSPACE = "/workspace"  # where the container backend mounts the job's folder in every node
SHARED = "/mnt/ctrflow"  # where the pipeline's train task and every node of its job mount the volume
LAST_LINES = 60  # torchrun's own traceback and failure summary take about 35


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


def volume_patch(volume: str):
    """The TrainJob option mounting PVC `volume` at SHARED in every node's container."""
    from kubeflow.trainer.options.kubernetes import (ContainerPatch, JobSetSpecPatch, JobSetTemplatePatch,
                                                     JobSpecPatch, JobTemplatePatch, PodSpecPatch, PodTemplatePatch,
                                                     ReplicatedJobPatch, RuntimePatch, TrainingRuntimeSpecPatch)

    mount = ContainerPatch(name="node", volume_mounts=[{"name": "ctrflow", "mountPath": SHARED}])
    claim = {"name": "ctrflow", "persistentVolumeClaim": {"claimName": volume}}
    pod = PodSpecPatch(volumes=[claim], containers=[mount])
    job = JobTemplatePatch(spec=JobSpecPatch(template=PodTemplatePatch(spec=pod)))
    node = ReplicatedJobPatch(name="node", template=job)
    return RuntimePatch(training_runtime_spec=TrainingRuntimeSpecPatch(
        template=JobSetTemplatePatch(spec=JobSetSpecPatch(replicated_jobs=[node]))))


def run_train_job(name: str, train_args: list[str], num_nodes: int, gpus_per_node: int, image: str,
                  backend: str = "kubernetes", namespace: str | None = None, timeout: int = 24 * 3600,
                  echo: Callable[[str], None] = print, volume: str = "") -> str:
    """Run `ctrflow train TRAIN_ARGS` as TrainJob `name` on `num_nodes` nodes of `gpus_per_node` GPUs
    (0: one CPU process per node) in `image`, wait for it and return its final status ("Complete").
    `volume`: a PVC every node mounts at SHARED (kubernetes backend)."""
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
    options = [Name(name), *([volume_patch(volume)] if volume else [])]
    client.train(runtime=client.get_runtime(RUNTIME), trainer=trainer, options=options)
    try:
        last = follow_logs(client, name, echo, whole_lines=backend == "kubernetes")
        status = final_status(client, name, timeout)
        if status != "Complete":
            raise UserError(f"TrainJob {name} {status.lower()}; its last log lines:\n" + "\n".join(last))
        return status
    finally:
        if backend == "container":  # a cluster keeps finished jobs for `kubectl describe`
            delete_quietly(client, name)


def run_staged_job(name: str, train_args: list[str], stages: dict[str, str], checkpoint_to: str | None,
                   num_nodes: int, gpus_per_node: int, image: str, backend: str = "kubernetes",
                   namespace: str | None = None, volume: str = "", echo: Callable[[str], None] = print) -> str:
    """`run_train_job` with each of `stages` (a `ctrflow train` flag without dashes: a file or folder
    here) copied to the job's shared folder and given to the job, and with `checkpoint_to`, the job
    training into that folder and its checkpoint copied to `checkpoint_to` once it completes. The
    shared folder: the container backend's job folder; on a cluster, NAME in PVC `volume`, which
    this process mounts at SHARED as every node does. A failed job keeps that folder, and says so."""
    here, there = (Path(SHARED) / name,) * 2 if backend == "kubernetes" else (job_folder(name), Path(WORKSPACE))
    if (stages or checkpoint_to) and backend == "kubernetes" and not (volume and Path(SHARED).is_dir()):
        raise UserError(f"--stage and --checkpoint-to on a cluster need --volume PVC, mounted here at {SHARED}")
    argv = list(train_args) + (["--out", f"{there}/ckpt"] if checkpoint_to else [])
    for flag, source in stages.items():
        argv += [f"--{flag}", str(there / stage(flag, Path(source), here))]
    try:
        status = run_train_job(name, argv, num_nodes, gpus_per_node, image, backend=backend, namespace=namespace,
                               echo=echo, volume=volume if backend == "kubernetes" else "")
    except UserError as err:
        if backend == "kubernetes" and not (stages or checkpoint_to):  # no folder of ours: the job's own --out
            raise
        raise UserError(f"{err}\nthe job's folder, its checkpoints to --resume from: {here}") from None
    if checkpoint_to:
        shutil.copytree(here / "ckpt", checkpoint_to, dirs_exist_ok=True)
        shutil.rmtree(here, ignore_errors=True)
    return status


def read_stages(given: list[str]) -> dict[str, str]:
    """`--stage FLAG=PATH` values as {FLAG: PATH}; refuses another form or a PATH that does not exist."""
    stages = {}
    for value in given:
        flag, _, path = value.partition("=")
        if not flag or not path:
            raise UserError(f"--stage {value!r}: give FLAG=PATH, e.g. data=prep/")
        if not Path(path).exists():
            raise UserError(f"--stage {value}: no such file or folder")
        stages[flag.lstrip("-")] = path
    return stages


def stage(flag: str, source: Path, folder: Path) -> Path:
    """Copy `source` (a file or folder) into `folder`/FLAG; returns where it went, relative to `folder`."""
    target = folder / flag / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, dirs_exist_ok=True)
    else:
        shutil.copy2(source, target)
    return target.relative_to(folder)


def follow_logs(client, name: str, echo: Callable[[str], None], whole_lines: bool = False) -> list[str]:
    """Print the job's log as it comes until the job ends; returns its last lines. `whole_lines`: the
    backend yields one line at a time (Kubernetes), not pieces of the stream cut anywhere (containers)."""
    last: deque[str] = deque(maxlen=LAST_LINES)
    pending = ""
    try:
        for piece in client.get_job_logs(name, follow=True):
            *lines, pending = (pending + piece + ("\n" if whole_lines else "")).split("\n")
            for line in lines:
                last.append(line)
                echo(line)
    except Exception as err:  # noqa: BLE001  the job deleted under us: its status says what happened
        pending += f"(log stream ended: {err})"
    if pending:
        last.append(pending)
        echo(pending)
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
    job.add_argument("--volume", default="", metavar="PVC",
                     help=f"kubernetes backend: a PersistentVolumeClaim every node mounts at {SHARED}")
    job.add_argument("--stage", action="append", default=[], metavar="FLAG=PATH",
                     help="copy PATH (a file or folder here) to the job's folder and give it to `ctrflow train "
                          f"--FLAG`, e.g. data=prep/ (the job's folder: the container backend's, or NAME in "
                          f"--volume, mounted here at {SHARED})")
    job.add_argument("--checkpoint-to", default=None, metavar="DIR",
                     help="train into the job's folder and copy the checkpoint to DIR once the job completes")
    job.add_argument("train_args", nargs="*", metavar="-- TRAIN_FLAGS",
                     help="`ctrflow train` flags, e.g. -- --data /workspace/data --out /workspace/ckpt")


def run_command(args) -> int:
    """`train-job`: the TrainJob, through a Docker API started for it with the container backend."""
    import contextlib

    from ctrflow_pipelines.engine import docker_api
    from ctrflow_pipelines.launch import check_shape

    check_shape(args.name, args.num_nodes, args.gpus_per_node)  # before any engine starts
    stages = read_stages(args.stage)
    with docker_api() if args.backend == "container" else contextlib.nullcontext():
        status = run_staged_job(args.name, args.train_args, stages, args.checkpoint_to, args.num_nodes,
                                args.gpus_per_node, args.image, backend=args.backend, namespace=args.namespace,
                                volume=args.volume)
    print(f"TrainJob {args.name}: {status}")
    return 0
