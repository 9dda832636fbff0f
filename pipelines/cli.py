"""`ctrflow pipeline compile|run|submit|schedule|launch-spec`: flags for every pipeline parameter, then
compile, run locally, submit or schedule. `ctrflow.cli` finds this module through the `ctrflow.commands` entry point
(`pipeline`) and hands it its parser and arguments; kfp loads only when the command runs."""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path
from typing import Any

HELP = "compile, run locally, submit or schedule the KFP pipelines"
TUNING_KINDS = ("vertex-hpt", "katib")  # launch-spec kinds that are tuning jobs (tuning_specs.py)


def add_parameter_flags(parser: argparse.ArgumentParser) -> None:
    """One `--name-with-dashes` flag per parameter of either pipeline (`--pipeline` picks which one the
    flags go to); left out, the pipeline's default holds."""
    from ctrflow_pipelines.compile import PIPELINES, pipeline_parameters

    group = parser.add_argument_group("pipeline parameters (default: the pipeline's own)")
    seen: dict[str, list[str]] = {}
    params = {}
    for pipeline in PIPELINES:
        for name, param in pipeline_parameters(pipeline).items():
            seen.setdefault(name, []).append(pipeline)
            params.setdefault(name, param)
    for name, param in params.items():
        kind = param.annotation if isinstance(param.annotation, type) else type(param.default)
        default = "required" if param.default is inspect.Parameter.empty else f"default: {param.default!r}"
        only = "" if len(seen[name]) == len(PIPELINES) else f"{seen[name][0]} pipeline; "
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"param_{name}", type=kind, default=None,
                           metavar=kind.__name__.upper(), help=f"{only}{default}")


def add_pipeline_choice(parser: argparse.ArgumentParser, default: str | None = "ctrflow") -> None:
    """`--pipeline ctrflow|daily`."""
    from ctrflow_pipelines.compile import PIPELINES

    parser.add_argument("--pipeline", choices=PIPELINES, default=default,
                        help=f"ctrflow: raw data to a registered model, once; daily: one day of continuous "
                             f"training (default {default or 'both'})")


def add_image_flag(parser: argparse.ArgumentParser) -> None:
    """`--image`: the container image of every task."""
    from ctrflow_components.image import IMAGE_ENV, TRAIN_IMAGE

    parser.add_argument("--image", default=None, help=f"container image of every task (default: ${IMAGE_ENV}, "
                                                       f"else {TRAIN_IMAGE}, what `make images` builds)")


def configure(parser: argparse.ArgumentParser) -> None:
    """Sub-commands of `ctrflow pipeline`."""
    sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    compile_ = sub.add_parser("compile", help="write the pipelines' IR YAML")
    add_pipeline_choice(compile_, default=None)
    compile_.add_argument("--out", default=None, help="YAML file to write (default: pipeline.yaml and "
                          "daily_pipeline.yaml, the committed files; with --out, one pipeline: ctrflow "
                          "unless --pipeline says)")
    add_image_flag(compile_)

    local = sub.add_parser("run", help="run the whole pipeline on this machine")
    local.add_argument("--local", action="store_true", required=True,
                       help="run on this machine with KFP's local runner (to run on a cluster, see `submit`)")
    local.add_argument("--runner", choices=("subprocess", "docker"), default="subprocess",
                       help="subprocess: every task in this Python environment; docker: every task in its "
                            "container image, through a Docker engine or podman (default subprocess)")
    add_image_flag(local)
    local.add_argument("--pipeline-root", default="runs/pipeline", help="folder of task outputs")
    add_pipeline_choice(local)
    local.add_argument("--days", nargs="+", default=None, metavar="PATTERN",
                       help="daily pipeline: one cycle per pattern (the day's files in --raw-dir), in order")
    local.add_argument("--log", default=None, metavar="FILE",
                       help="write the tasks' logs here and show only task progress (default: show all)")
    add_parameter_flags(local)

    submit = sub.add_parser("submit", help="submit a run to Kubeflow Pipelines or Vertex AI")
    submit.add_argument("--host", help="KFP API endpoint, e.g. http://localhost:8080")
    add_pipeline_choice(submit)
    submit.add_argument("--experiment", default="ctrflow", help="KFP experiment name")
    submit.add_argument("--run-name", default=None, help="KFP run / Vertex job display name")
    submit.add_argument("--namespace", default=None, help="KFP namespace (multi-user installs)")
    submit.add_argument("--vertex-project", help="submit to Vertex AI Pipelines in this GCP project")
    submit.add_argument("--vertex-region", default="us-central1", help="Vertex AI region")
    submit.add_argument("--pipeline-root", default=None, help="gs:// folder for Vertex AI task outputs")
    submit.add_argument("--service-account", default=None, help="service account of the Vertex AI job")
    add_image_flag(submit)
    add_parameter_flags(submit)
    configure_schedule(sub)
    configure_launch_spec(sub)
    from ctrflow_pipelines.trainjob import configure as configure_train_job

    configure_train_job(sub)


def configure_schedule(sub) -> None:
    """`ctrflow pipeline schedule`: a recurring run on a KFP API server."""
    schedule = sub.add_parser("schedule", help="create a recurring run (the daily pipeline by default) on KFP")
    schedule.add_argument("--cron", required=True,
                          help='when to run, a cron expression: 5 fields ("0 3 * * *": 03:00 every day) or '
                               "KFP's 6 (seconds first)")
    schedule.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    add_pipeline_choice(schedule, default="daily")
    schedule.add_argument("--experiment", default="ctrflow", help="KFP experiment name")
    schedule.add_argument("--job-name", default=None, help="recurring run name (default: ctrflow-<pipeline>)")
    schedule.add_argument("--namespace", default=None, help="KFP namespace (multi-user installs)")
    schedule.add_argument("--max-concurrency", type=int, default=1,
                          help="runs at the same time (default 1: a day starts after the previous one ended)")
    schedule.add_argument("--catchup", action="store_true",
                          help="after a pause, run the missed days too (default: only the newest)")
    add_image_flag(schedule)
    add_parameter_flags(schedule)


def configure_launch_spec(sub) -> None:
    """`ctrflow pipeline launch-spec`: a multi-node training spec, or a tuning job, for an existing engine."""
    from ctrflow_components.image import TRAIN_IMAGE
    from ctrflow_pipelines.launch import KINDS

    spec = sub.add_parser("launch-spec", help="write a multi-node training spec (TrainJob, PyTorchJob, Vertex AI) "
                                              "or a tuning job (Vertex AI, Katib)",
                          description="Write the spec that runs `ctrflow train` under torchrun on NUM_NODES nodes "
                                      "of GPUS_PER_NODE GPUs, or a tuning job whose trials do (vertex-hpt, katib: "
                                      "--space, --trials, --parallel); give the train flags after `--`.")
    spec.add_argument("--kind", required=True, choices=KINDS + TUNING_KINDS,
                      help="Kubeflow Trainer v2 TrainJob, Training Operator PyTorchJob, Vertex AI CustomJob, Vertex "
                           "AI HyperparameterTuningJob, or Katib Experiment (PyTorchJob trials)")
    spec.add_argument("--name", default="ctrflow-train", help="job name (and torchrun rendezvous id)")
    spec.add_argument("--image", default=TRAIN_IMAGE, help=f"training image (default: {TRAIN_IMAGE})")
    spec.add_argument("--num-nodes", type=int, default=1)
    spec.add_argument("--gpus-per-node", type=int, default=8, help="0: one CPU process per node")
    spec.add_argument("--namespace", default=None, help="Kubernetes namespace (trainjob, pytorchjob, katib)")
    spec.add_argument("--runtime", default="torch-distributed", help="ClusterTrainingRuntime (trainjob)")
    spec.add_argument("--machine-type", default="a3-highgpu-8g", help="Vertex AI machine type (vertex, vertex-hpt)")
    spec.add_argument("--accelerator", default="NVIDIA_H100_80GB",
                      help="Vertex AI accelerator type (vertex, vertex-hpt)")
    spec.add_argument("--space", default=None, metavar="FILE",
                      help="search space file, as `ctrflow tune` reads it (vertex-hpt, katib)")
    spec.add_argument("--trials", type=int, default=16, metavar="N", help="trials in all (vertex-hpt, katib)")
    spec.add_argument("--parallel", type=int, default=2, metavar="P", help="trials at once (vertex-hpt, katib)")
    spec.add_argument("--out", default="-", help="file to write (.json: JSON, else YAML; default: stdout)")
    spec.add_argument("train_args", nargs="*", metavar="-- TRAIN_FLAGS",
                      help="`ctrflow train` flags, e.g. -- --data /mnt/data --out /mnt/ckpt --model dlrm")


def build_launch_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The spec `args` ask for."""
    from ctrflow.errors import UserError
    from ctrflow_pipelines.launch import launch_spec

    if args.kind in TUNING_KINDS:
        from ctrflow.tune.space import read_space
        from ctrflow_pipelines.tuning_specs import katib_experiment, vertex_tuning_job

        if not args.space:
            raise UserError(f"--kind {args.kind} needs --space FILE (the search space)")
        space = read_space(args.space)
        if args.kind == "katib":
            return katib_experiment(args.name, args.image, args.train_args, space, args.trials, args.parallel,
                                    args.num_nodes, args.gpus_per_node, namespace=args.namespace)
        return vertex_tuning_job(args.name, args.image, args.train_args, space, args.trials, args.parallel,
                                 args.num_nodes, args.gpus_per_node, machine_type=args.machine_type,
                                 accelerator=args.accelerator)
    options = {"trainjob": {"runtime": args.runtime, "namespace": args.namespace},
               "pytorchjob": {"namespace": args.namespace},
               "vertex": {"machine_type": args.machine_type, "accelerator": args.accelerator}}[args.kind]
    return launch_spec(args.kind, args.name, args.image, args.train_args, args.num_nodes, args.gpus_per_node,
                       **options)


def write_launch_spec(args: argparse.Namespace) -> str:
    """Build the spec `args` ask for and write it; returns where it went."""
    import sys

    import yaml

    spec = build_launch_spec(args)
    text = (json.dumps(spec, indent=2) + "\n" if args.out.endswith(".json")
            else yaml.safe_dump(spec, sort_keys=False, width=1000))
    if args.out == "-":
        sys.stdout.write(text)
        return "stdout"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return args.out


def parameter_values(args: argparse.Namespace) -> dict[str, Any]:
    """The parameters of the chosen pipeline given on the command line; a flag of the other
    pipeline only, or a required parameter left out, is refused, naming it."""
    from ctrflow.errors import UserError
    from ctrflow_pipelines.compile import PIPELINES, pipeline_parameters

    pipeline = getattr(args, "pipeline", None) or "ctrflow"
    mine = pipeline_parameters(pipeline)
    given = {name: value for name, value in vars(args).items()
             if name.startswith("param_") and value is not None}
    for flag in given:
        if flag[len("param_"):] not in mine:
            other = next(p for p in PIPELINES if p != pipeline)
            raise UserError(f"--{flag[len('param_'):].replace('_', '-')}: a parameter of the {other} pipeline, "
                            f"not of {pipeline} (--pipeline {other})")
    values = {flag[len("param_"):]: value for flag, value in given.items()}
    missing = [name for name, param in mine.items() if param.default is inspect.Parameter.empty and name not in values]
    if missing:
        raise UserError(f"the {pipeline} pipeline needs " + ", ".join(f"--{n.replace('_', '-')}" for n in missing))
    return values


def run(args: argparse.Namespace) -> int:
    """Do the chosen action, its tasks in `--image` when given; prints where its result is."""
    if args.action in ("launch-spec", "train-job"):  # their --image is the job's, not the tasks'
        return run_action(args)
    from ctrflow_pipelines.compile import tasks_in

    with tasks_in(args.image):
        return run_action(args)


def run_action(args: argparse.Namespace) -> int:
    """Do the chosen action."""
    from ctrflow.errors import UserError

    if args.action == "compile":
        from ctrflow_pipelines.compile import COMMITTED_FILES, PIPELINES, compile_pipeline

        chosen = args.pipeline or ("ctrflow" if args.out else None)
        for pipeline in [chosen] if chosen else PIPELINES:
            print(f"wrote {compile_pipeline(args.out or COMMITTED_FILES[pipeline], pipeline)}")
        return 0
    if args.action == "train-job":
        from ctrflow_pipelines.trainjob import run_command

        return run_command(args)
    if args.action == "launch-spec":
        where = write_launch_spec(args)
        if where != "stdout":
            print(f"wrote {where}")
        return 0
    arguments = parameter_values(args)
    if args.action == "run":
        return run_locally(args, arguments)
    if args.action == "schedule":
        from ctrflow_pipelines.schedule import schedule_kfp

        recurring = schedule_kfp(args.host, args.cron, arguments, args.pipeline, args.experiment, args.job_name,
                                 args.namespace, args.max_concurrency, args.catchup)
        print(f"scheduled recurring run {recurring} ({args.pipeline} pipeline, cron {args.cron!r}) on {args.host}")
        return 0
    if args.vertex_project:
        from ctrflow_pipelines.submit import submit_vertex

        if not args.pipeline_root:
            raise UserError("--vertex-project needs --pipeline-root gs://BUCKET/PATH")
        name = submit_vertex(args.vertex_project, args.vertex_region, args.pipeline_root, arguments,
                             args.run_name or "ctrflow", args.service_account, args.pipeline)
        print(f"submitted Vertex AI pipeline job {name}")
        return 0
    if not args.host:
        raise UserError("submit needs --host URL (Kubeflow Pipelines) or --vertex-project")
    from ctrflow_pipelines.submit import submit_kfp

    run_id = submit_kfp(args.host, arguments, args.experiment, args.run_name, args.namespace, args.pipeline)
    print(f"submitted KFP run {run_id} to {args.host}")
    return 0


def run_locally(args: argparse.Namespace, arguments: dict[str, Any]) -> int:
    """`run --local`: the pipeline once, or the daily cycle once per `--days` pattern, in order; prints
    the headline of each run."""
    from ctrflow.errors import UserError
    from ctrflow_pipelines.local import run_days, run_local, summarize_local_run

    if args.days and args.pipeline != "daily":
        raise UserError("--days: one daily cycle per pattern; give --pipeline daily")
    try:
        if args.pipeline == "daily":
            for day in run_days(args.pipeline_root, arguments, args.days, log_file=args.log, runner=args.runner):
                print(json.dumps(day), flush=True)
        else:
            run_dir = run_local(args.pipeline_root, arguments, log_file=args.log, runner=args.runner)
            print(json.dumps(summarize_local_run(Path(run_dir)), indent=2))
    except RuntimeError as err:  # the failed task's own log says why
        where = f" (task logs: {args.log})" if args.log else ""
        raise UserError(re.sub(r"\x1b\[[0-9;]*m", "", str(err).splitlines()[0]) + where) from None
    return 0
