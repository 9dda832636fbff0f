"""Hyperparameter tuning specs for the managed services: a Vertex AI `HyperparameterTuningJob` and a
Katib `Experiment`, both over the search space file `ctrflow tune` reads.

A trial of either is the multi-node training job of `launch.py` (a Vertex AI CustomJob's worker
pools, a Training Operator PyTorchJob) running `ctrflow train` with the trial's values as its flags
and `--report-metrics vertex|katib`, so the service reads the AUC each validation reports; the
objective is the last one (the model the trial's final checkpoint holds), maximized. Each trial
writes into its own folder under the `--out` of the train flags: `trial_<id>` on Vertex AI (from
`CLOUD_ML_TRIAL_ID`), the trial's name on Katib.

The services pass values differently: Vertex AI appends `--<parameterId>=<value>` to the container's
arguments, so a parameter id is the train flag's name (`sparse-lr`); Katib substitutes
`${trialParameters.<name>}` in the trial template, where the flags are written out. Integer choices
go as categorical strings on Vertex AI (its discrete values are doubles, and `--embedding-dim=16.0`
would not parse); lists of widths as "256,128" (the `--top-mlp` syntax). The data's frequency
threshold cannot be searched here (the trials read the data as it is: `ctrflow tune` makes threshold
views), nor a yes/no field (its flags take no value).
"""

from __future__ import annotations

import copy
from typing import Any

from ctrflow.errors import UserError
from ctrflow.tune.space import THRESHOLD, Param, SearchSpace, encode_choice
from ctrflow_pipelines.launch import pytorchjob, vertex_custom_job

METRIC = "auc"
TRIAL_DIRS = {"vertex-hpt": "trial_${CLOUD_ML_TRIAL_ID}", "katib": "${trialParameters.trialName}"}
# Katib's conditions for a PyTorchJob trial (gjson paths over the job's status), from its examples
KATIB_SUCCESS = 'status.conditions.#(type=="Succeeded")#|#(status=="True")#'
KATIB_FAILURE = 'status.conditions.#(type=="Failed")#|#(status=="True")#'


def train_flag(param: Param, where: str) -> str:
    """The `ctrflow train` flag (without dashes) that sets `param`'s field; UserError where none can."""
    from ctrflow.commands.train import all_flags

    if param.key == THRESHOLD:
        raise UserError(f"{where}: {THRESHOLD} cannot be searched by a managed service (trials read the data as "
                        f"it is); preprocess at the threshold you want, or tune it with `ctrflow tune`")
    flags = {key: flag for flag, key, options, _text in all_flags() if options.get("action") is None}
    if param.key not in flags:
        raise UserError(f"{where}: {param.key} is a yes/no field; its flags take no value, so a service cannot set it")
    return flags[param.key][2:]


def trial_args(train_args: list[str], kind: str, report: str) -> list[str]:
    """`train_args` with `--out DIR` made per trial (`DIR/<trial>`) and the metrics reported for `report`."""
    args = list(train_args)
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            args[i + 1] = f"{args[i + 1].rstrip('/')}/{TRIAL_DIRS[kind]}"
            break
        if arg.startswith("--out="):
            args[i] = f"{arg.rstrip('/')}/{TRIAL_DIRS[kind]}"
            break
    else:
        raise UserError(f"--kind {kind}: give the train flags `-- --out DIR ...`: each trial writes DIR/<trial>")
    return [*args, "--report-metrics", report]


def check_counts(trials: int, parallel: int) -> None:
    """UserError for trial counts a service would refuse."""
    if trials < 1:
        raise UserError(f"--trials must be at least 1, got {trials}")
    if not 1 <= parallel <= trials:
        raise UserError(f"--parallel {parallel} must be between 1 and --trials {trials}")


def vertex_parameter(param: Param, where: str) -> dict[str, Any]:
    """One `StudySpec.ParameterSpec` (REST JSON) for `param`."""
    spec: dict[str, Any] = {"parameterId": train_flag(param, where)}
    if param.kind == "choice":
        if all(isinstance(c, float) for c in param.choices):
            spec["discreteValueSpec"] = {"values": list(param.choices)}
        else:
            spec["categoricalValueSpec"] = {"values": [str(encode_choice(c)) for c in param.choices]}
        return spec
    if param.step is not None:  # a stepped range: the values it can take, as Vertex AI has no step
        count = round((param.high - param.low) / param.step) + 1
        values = [param.low + i * param.step for i in range(count)]
        if param.kind == "int":
            spec["categoricalValueSpec"] = {"values": [str(int(v)) for v in values]}
        else:
            spec["discreteValueSpec"] = {"values": [round(v, 12) for v in values]}
        return spec
    value_spec = "integerValueSpec" if param.kind == "int" else "doubleValueSpec"
    cast = int if param.kind == "int" else float
    spec[value_spec] = {"minValue": cast(param.low), "maxValue": cast(param.high)}
    spec["scaleType"] = "UNIT_LOG_SCALE" if param.log else "UNIT_LINEAR_SCALE"
    return spec


def vertex_tuning_job(name: str, image: str, train_args: list[str], space: SearchSpace, trials: int,
                      parallel: int, num_nodes: int, gpus_per_node: int, **machine: Any) -> dict[str, Any]:
    """A Vertex AI HyperparameterTuningJob (REST body of projects.locations.hyperparameterTuningJobs.create):
    AUC maximized, the median of trials stopping the ones behind, trials as `launch.vertex_custom_job`'s
    worker pools."""
    check_counts(trials, parallel)
    parameters = [vertex_parameter(p, f"{space.source}: {p.key}") for p in space.params]
    custom = vertex_custom_job(name, image, trial_args(train_args, "vertex-hpt", "vertex"), num_nodes,
                               gpus_per_node, **machine)
    pools = custom["jobSpec"]["workerPoolSpecs"]
    for pool in pools:
        # Vertex AI appends `--<parameterId>=<value>` to the args: the script passes them on ("$0" is the first)
        container = pool["containerSpec"]
        container["command"][-1] += ' "$@"'
        container["args"] = ["ctrflow"]
    return {"displayName": name,
            "studySpec": {"metrics": [{"metricId": METRIC, "goal": "MAXIMIZE"}], "parameters": parameters,
                          "measurementSelectionType": "LAST_MEASUREMENT",
                          "medianAutomatedStoppingSpec": {"useElapsedDuration": False}},
            "maxTrialCount": trials, "parallelTrialCount": parallel, "maxFailedTrialCount": max(1, trials // 4),
            "trialJobSpec": {"workerPoolSpecs": pools}}


def katib_name(param: Param) -> str:
    """The Katib parameter name of `param`: its train flag with underscores (`sparse_lr`)."""
    return train_flag(param, param.key).replace("-", "_")


def katib_parameter(param: Param, where: str) -> dict[str, Any]:
    """One Katib `ParameterSpec` for `param` (feasible space values are strings)."""
    name = train_flag(param, where).replace("-", "_")
    if param.kind == "choice":
        numeric = all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in param.choices)
        return {"name": name, "parameterType": "discrete" if numeric else "categorical",
                "feasibleSpace": {"list": [str(encode_choice(c)) for c in param.choices]}}
    space = {"min": str(param.low), "max": str(param.high)}
    if param.step is not None:
        space["step"] = str(param.step)
    if param.log:
        space["distribution"] = "logUniform"
    return {"name": name, "parameterType": "int" if param.kind == "int" else "double", "feasibleSpace": space}


def katib_experiment(name: str, image: str, train_args: list[str], space: SearchSpace, trials: int, parallel: int,
                     num_nodes: int, gpus_per_node: int, namespace: str | None = None) -> dict[str, Any]:
    """A Katib Experiment (kubeflow.org/v1beta1): TPE over the space, AUC maximized from the trials'
    stdout (`--report-metrics katib`), median stopping, a PyTorchJob trial template (`launch.pytorchjob`)."""
    check_counts(trials, parallel)
    parameters = [katib_parameter(p, f"{space.source}: {p.key}") for p in space.params]
    flags = [f"--{train_flag(p, p.key)}=${{trialParameters.{katib_name(p)}}}" for p in space.params]
    job = pytorchjob(name, image, [*trial_args(train_args, "katib", "katib"), *flags], num_nodes, gpus_per_node)
    job.pop("metadata")  # Katib names each trial's job
    trial_parameters = [{"name": katib_name(p), "description": f"the config field {p.key}",
                         "reference": katib_name(p)} for p in space.params]
    trial_parameters.append({"name": "trialName", "description": "the trial's name: its checkpoint folder",
                             "reference": "${trialSpec.Name}"})
    return {"apiVersion": "kubeflow.org/v1beta1", "kind": "Experiment",
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
            "spec": {"objective": {"type": "maximize", "objectiveMetricName": METRIC,
                                   "additionalMetricNames": ["logloss"]},
                     "algorithm": {"algorithmName": "tpe"}, "earlyStopping": {"algorithmName": "medianstop"},
                     "parallelTrialCount": parallel, "maxTrialCount": trials,
                     "maxFailedTrialCount": max(1, trials // 4),
                     "metricsCollectorSpec": {"collector": {"kind": "StdOut"}},
                     "parameters": parameters,
                     "trialTemplate": {"primaryContainerName": "pytorch", "trialParameters": trial_parameters,
                                       "primaryPodLabels": {"training.kubeflow.org/job-role": "master"},
                                       "successCondition": KATIB_SUCCESS, "failureCondition": KATIB_FAILURE,
                                       "trialSpec": copy.deepcopy(job)}}}

