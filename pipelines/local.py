"""Run the whole pipeline on this machine with KFP's local runner (no Kubernetes).

With the subprocess runner every task runs as a subprocess of this Python environment, so ctrflow
must be installed here. With the docker runner every task runs in its container image, through a
Docker engine or a podman service started for the run (`ctrflow_pipelines.engine`): the pipeline
root, the folder of a local MLflow store and every absolute path given as an argument are mounted
at the same paths, on the host's network (a tracking server on the host answers at its own
address). Outputs land under `pipeline_root/<pipeline>-<timestamp>/<task>/<output>`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterator


def absolute_tracking_uri(uri: str) -> str:
    """The MLflow URI the tasks should use, with a relative SQLite path made absolute (tasks may run
    elsewhere) and "" resolved as the steps would ($MLFLOW_TRACKING_URI, else ./mlflow.db)."""
    from ctrflow.tracking import resolve_tracking_uri

    uri = resolve_tracking_uri(uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str(Path(uri[len(prefix):]).resolve())
    return uri


class TaskProgress(io.TextIOBase):
    """Stdout during a local run: everything goes to a log file, and only the runner's
    "Executing task" / "finished with status" lines reach the console."""

    PROGRESS = re.compile(r"Executing task|finished with status")

    def __init__(self, log, console) -> None:
        self.log, self.console, self.pending = log, console, ""

    def write(self, text: str) -> int:
        self.log.write(text)
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if self.PROGRESS.search(line):
                self.console.write(line + "\n")
                self.console.flush()
        return len(text)

    def flush(self) -> None:
        self.log.flush()


def run_local(pipeline_root: str | os.PathLike, arguments: dict[str, Any],
              log_file: str | os.PathLike | None = None, pipeline: str = "ctrflow", append: bool = False,
              runner: str = "subprocess") -> Path:
    """Run `pipeline` ("ctrflow" or "daily") with `arguments` (its parameter values) under
    `pipeline_root` with `runner` ("subprocess" or "docker"); returns the run's output folder. With
    `log_file`, the tasks' logs go there (after what it holds with `append`) and the console shows one
    line per task start and end. Raises RuntimeError naming the failed task."""
    if runner == "docker" and int(arguments.get("train_nodes", 1)) > 1:
        from ctrflow.errors import UserError

        # the train task would have to start the TrainJob's containers from inside its own
        raise UserError("--train-nodes above 1 runs the train step as a TrainJob of containers: "
                        "use --runner subprocess")
    if log_file is None:
        return _run(pipeline_root, arguments, pipeline, runner)
    import sys

    with open(log_file, "a" if append else "w") as log, contextlib.redirect_stdout(TaskProgress(log, sys.stdout)):
        return _run(pipeline_root, arguments, pipeline, runner)


def run_days(pipeline_root: str | os.PathLike, arguments: dict[str, Any], days: list[str] | None,
             log_file: str | os.PathLike | None = None, runner: str = "subprocess") -> Iterator[dict[str, Any]]:
    """The daily pipeline once per pattern of `days` (its `day_files`; None: once, as `arguments` say),
    in order, each day starting from the state the one before recorded; yields each day's headline."""
    from ctrflow.daily import DailyState
    from ctrflow.errors import UserError

    if not arguments.get("state") or not arguments.get("raw_dir"):
        raise UserError("the daily pipeline needs --state DIR (the loop's state) and --raw-dir DIR (the days' files)")
    state_dir = arguments["state"] if "://" in arguments["state"] else str(Path(arguments["state"]).resolve())
    for k, pattern in enumerate(days or [arguments.get("day_files")]):
        given = {**arguments, "state": state_dir, **({"day_files": pattern} if pattern is not None else {})}
        run_dir = run_local(pipeline_root, given, log_file=log_file, pipeline="daily", append=k > 0, runner=runner)
        state = DailyState.load(state_dir)
        yield {"day_files": pattern, "run_dir": str(run_dir), "day": state.day,
               **(state.history[-1] if state.history else {})}


def _run(pipeline_root: str | os.PathLike, arguments: dict[str, Any], pipeline: str, runner: str) -> Path:
    import builtins

    from ctrflow_pipelines.engine import docker_api

    printing = builtins.print
    try:
        engine = contextlib.ExitStack()
        if runner == "docker":
            engine.enter_context(docker_api())
            engine.enter_context(containers_kept_until_read())
        with engine, branch_artifacts():
            return _run_pipeline(pipeline_root, arguments, pipeline, runner)
    finally:
        # KFP's runner indents task output by swapping `print` for a wrapper and back, per task; tasks
        # in parallel threads restore each other's wrappers, leaving a print that indents everything after
        builtins.print = printing


@contextlib.contextmanager
def branch_artifacts() -> Iterator[None]:
    """Within: KFP's local runner resolves a `dsl.OneOf` of artifacts (the train step's checkpoint, from
    the branch for one node or the TrainJob's) to the output of the branch that ran, as a cluster
    does; kfp 2.17's local runner resolves OneOf for parameters only."""
    from kfp.local.orchestrator.orchestrator_utils import OrchestratorUtils

    def resolve(cls, dag_outputs_spec, io_store) -> dict[str, Any]:
        outputs = {}
        for key, spec in dag_outputs_spec.artifacts.items():
            found = []
            for selector in spec.artifact_selectors:
                try:
                    found.append(io_store.get_task_output(selector.producer_subtask, selector.output_artifact_key))
                except (KeyError, ValueError):  # a branch that did not run
                    continue
            if len(found) != 1:
                raise ValueError(f"DAG output {key!r}: {len(found)} branches produced it, expected 1")
            outputs[key] = found[0]
        return outputs

    original = OrchestratorUtils.__dict__["get_dag_output_artifacts"]
    OrchestratorUtils.get_dag_output_artifacts = classmethod(resolve)
    try:
        yield
    finally:
        OrchestratorUtils.get_dag_output_artifacts = original


@contextlib.contextmanager
def containers_kept_until_read() -> Iterator[None]:
    """Within: KFP's DockerRunner removes each task's container after reading its logs and exit
    status, not on exit. kfp 2.17 starts containers with `auto_remove`, so a task that ends quickly
    races its own removal: podman answers an inspection during removal with an error 500 that fails
    the run, and a container already gone is taken for a success whatever its exit status."""
    import docker
    from kfp.local import docker_task_handler

    def run_container(client, image: str, command: list[str], volumes: dict, **run_args) -> int:
        image = docker_task_handler.add_latest_tag_if_not_present(image)
        try:
            client.images.get(image)
            print(f"Found image {image!r}\n")  # KFP's own words, as its log has them
        except docker.errors.ImageNotFound:
            print(f"Pulling image {image!r}")
            client.images.pull(image)
        container = client.containers.run(image=image, command=command, detach=True, stdout=True,
                                          stderr=True, volumes=volumes, **run_args)
        try:
            for line in container.logs(stream=True):
                print(line.decode(), end="")
            return container.wait()["StatusCode"]
        finally:
            container.remove(force=True)

    original = docker_task_handler.run_docker_container
    docker_task_handler.run_docker_container = run_container
    try:
        yield
    finally:
        docker_task_handler.run_docker_container = original


def docker_runner(arguments: dict[str, Any]):
    """KFP's DockerRunner on the host's network, with the folder of a local MLflow store and every
    absolute path among `arguments` (or its folder, for a file) mounted at the same path."""
    import kfp.local
    from docker.types import Mount

    folders = set()
    for value in arguments.values():
        if isinstance(value, str) and value.startswith("sqlite:///"):  # a store made on first use
            store = Path(value.removeprefix("sqlite:///")).parent
            store.mkdir(parents=True, exist_ok=True)
            folders.add(str(store))
        elif isinstance(value, str) and Path(value).is_absolute() and Path(value).exists():
            folders.add(value if Path(value).is_dir() else str(Path(value).parent))
    mounts = [Mount(target=folder, source=folder, type="bind") for folder in sorted(folders)]
    # shared memory for DataLoader workers and torchrun's processes
    return kfp.local.DockerRunner(network_mode="host", mounts=mounts, shm_size="1g")


def _run_pipeline(pipeline_root: str | os.PathLike, arguments: dict[str, Any], pipeline: str, runner: str) -> Path:
    import kfp.local

    from ctrflow_pipelines.compile import pipeline_function

    root = Path(pipeline_root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    arguments = {**arguments,
                 "mlflow_tracking_uri": absolute_tracking_uri(arguments.get("mlflow_tracking_uri", ""))}
    chosen = docker_runner(arguments) if runner == "docker" else kfp.local.SubprocessRunner(use_venv=False)
    kfp.local.init(runner=chosen, pipeline_root=str(root))
    before = set(root.iterdir())
    with warnings.catch_warnings():
        # expected here: the image, display names and GPU requests only matter on a cluster
        warnings.filterwarnings("ignore", message=".*(have no effect in the current local runner|base image)")
        function = pipeline_function(pipeline)
        function(**arguments)
    created = sorted(p for p in set(root.iterdir()) - before if p.name.startswith(function.name))
    return created[-1]


def task_output(run_dir: Path, task: str, output: str) -> Path | None:
    """The folder or file of `output` of `task` that was produced (the first, for a task in a loop)."""
    found = sorted(p for p in run_dir.glob(f"{task}*/{output}") if p.exists())
    return found[0] if found else None


def output_parameter(run_dir: Path, task: str) -> Any:
    """The return value of a task (its `Output` parameter in executor_output.json)."""
    path = task_output(run_dir, task, "executor_output.json")
    if path is None:
        return None
    return json.loads(path.read_text()).get("parameterValues", {}).get("Output")


def summarize_local_run(run_dir: Path, valid_day: str = "day_1") -> dict[str, Any]:
    """The headline of a local run: validation AUC, teacher AUC (synthetic data), MLflow parent run,
    Triton repository and its registered version."""
    summary: dict[str, Any] = {"run_dir": str(run_dir), "mlflow_run_id": output_parameter(run_dir, "start-run")}
    metrics = task_output(run_dir, "evaluate", "report/metrics.json")
    if metrics:
        result = json.loads(metrics.read_text())
        summary.update(auc=result["auc"], logloss=result["logloss"], rows=result["rows"])
    synth = task_output(run_dir, "raw-data", "raw/synth.json")
    if synth:
        summary["teacher_auc"] = json.loads(synth.read_text())["teacher_auc"].get(valid_day)
    repository = task_output(run_dir, "export", "repository")
    if repository:
        summary["repository"] = str(repository)
        output = json.loads(task_output(run_dir, "export", "executor_output.json").read_text())
        meta = output["artifacts"]["repository"]["artifacts"][0].get("metadata", {})
        summary["registered_version"] = meta.get("registered_version")
        summary["model_name"] = meta.get("name")
    return summary
