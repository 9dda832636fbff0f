"""Tuning jobs for the managed services: a Vertex AI HyperparameterTuningJob checked against Vertex's
own proto (google-cloud-aiplatform), a Katib Experiment against Katib's API models
(kubeflow-katib-api) and the rules its admission webhook applies; each trial's command, with the
values the service gives it, parsed by `ctrflow train` into the config fields the space names."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("kfp")

from ctrflow.cli import build_parser, main  # noqa: E402
from ctrflow.commands.train import config_from_args  # noqa: E402
from ctrflow.errors import UserError  # noqa: E402
from ctrflow.tune.space import parse_space  # noqa: E402
from ctrflow_pipelines.tuning_specs import katib_experiment, vertex_tuning_job  # noqa: E402

TRAIN = ["--data", "/mnt/data", "--out", "/mnt/ckpt", "--model", "dlrm"]
SPACE = {"lr": {"low": 0.0003, "high": 0.01, "log": True}, "sparse_lr": {"low": 0.003, "high": 0.1, "log": True},
         "embedding_dim": {"choices": [8, 16, 32]}, "dropout": {"choices": [0.0, 0.2, 0.4]},
         "batch_size": {"low": 1024, "high": 4096, "step": 1024}, "top_mlp": {"choices": [[128, 64], [256, 128]]},
         "dense": {"choices": ["adam", "adamw"]}, "warmup_steps": {"low": 0, "high": 400}}
# values a service might hand a trial, by config field, and what the trial's config must then hold
PICKED = {"optim.lr": ("0.0021", 0.0021), "optim.sparse_lr": ("0.05", 0.05), "model.embedding_dim": ("16", 16),
          "model.dropout": ("0.2", 0.2), "data.batch_size": ("3072", 3072), "model.top_mlp": ("256,128", (256, 128)),
          "optim.dense": ("adamw", "adamw"), "optim.warmup_steps": ("300", 300)}


@pytest.fixture(scope="module")
def space():
    return parse_space(SPACE, "space.yaml")


def train_config(train_args: list[str]):
    """The TrainConfig `ctrflow train ARGS` would run."""
    argv = ["train", *train_args]
    return config_from_args(build_parser(argv).parse_args(argv))


def stand_in_torchrun(tmp_path) -> dict:
    """An environment whose `torchrun` prints its arguments one a line (the real one would train)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (bin_dir / "torchrun").chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    cluster = {"cluster": {"workerpool0": ["chief-0:2222"]}, "task": {"type": "workerpool0", "index": 0}}
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CLUSTER_SPEC": json.dumps(cluster),
            "CLOUD_ML_TRIAL_ID": "7"}


def test_vertex_tuning_job_parses_as_vertex_proto(space):
    aiplatform = pytest.importorskip("google.cloud.aiplatform_v1")
    from google.protobuf import json_format

    job = vertex_tuning_job("ctr-hpt", "img:1", TRAIN, space, trials=16, parallel=2, num_nodes=2, gpus_per_node=8)
    message = aiplatform.HyperparameterTuningJob.pb(aiplatform.HyperparameterTuningJob())
    json_format.ParseDict(job, message)  # unknown fields, wrong enum names or types raise
    parsed = aiplatform.HyperparameterTuningJob.wrap(message)
    assert (parsed.max_trial_count, parsed.parallel_trial_count) == (16, 2)
    metric = parsed.study_spec.metrics[0]
    assert metric.metric_id == "auc" and metric.goal == aiplatform.StudySpec.MetricSpec.GoalType.MAXIMIZE
    specs = {p.parameter_id: p for p in parsed.study_spec.parameters}
    assert specs["lr"].scale_type == aiplatform.StudySpec.ParameterSpec.ScaleType.UNIT_LOG_SCALE
    assert (specs["lr"].double_value_spec.min_value, specs["lr"].double_value_spec.max_value) == (0.0003, 0.01)
    assert list(specs["embedding-dim"].categorical_value_spec.values) == ["8", "16", "32"]
    assert list(specs["dropout"].discrete_value_spec.values) == [0.0, 0.2, 0.4]
    assert list(specs["batch-size"].categorical_value_spec.values) == ["1024", "2048", "3072", "4096"]
    assert specs["cross-layers"].integer_value_spec.max_value == 4
    pools = parsed.trial_job_spec.worker_pool_specs
    assert [p.replica_count for p in pools] == [1, 1] and pools[0].machine_spec.accelerator_count == 8


def test_vertex_trial_passes_the_appended_values_to_train(space, tmp_path):
    """Vertex AI appends `--<parameterId>=<value>` to the container's args: the trial trains with them."""
    job = vertex_tuning_job("ctr-hpt", "img:1", TRAIN, space, trials=16, parallel=2, num_nodes=1, gpus_per_node=0)
    container = job["trialJobSpec"]["workerPoolSpecs"][0]["containerSpec"]
    ids = {p.key: spec["parameterId"] for p, spec in zip(space.params, job["studySpec"]["parameters"])}
    appended = [f"--{ids[key]}={text}" for key, (text, _value) in PICKED.items()]
    done = subprocess.run([*container["command"], *container["args"], *appended], env=stand_in_torchrun(tmp_path),
                          capture_output=True, text=True, check=True)
    args = done.stdout.splitlines()
    config = train_config(args[args.index("train") + 1:])
    assert config.out == "/mnt/ckpt/trial_7" and config.data.path == "/mnt/data"  # each trial its own folder
    for key, (_text, value) in PICKED.items():
        assert config.flat()[key] == value, key
    assert args[args.index("--report-metrics") + 1] == "vertex"


def test_katib_experiment_parses_as_katib_models_and_passes_its_webhook_rules(space):
    models = pytest.importorskip("kubeflow_katib_api.models")

    experiment = katib_experiment("ctr-hpt", "img:1", TRAIN, space, trials=16, parallel=2, num_nodes=2,
                                  gpus_per_node=8, namespace="team")
    parsed = models.V1beta1Experiment.from_dict(experiment)
    assert parsed.to_dict() == experiment  # nothing the models do not know (they drop unknown fields)
    spec = experiment["spec"]
    template = spec["trialTemplate"]
    for replica in template["trialSpec"]["spec"]["pytorchReplicaSpecs"].values():
        pod = models.IoK8sApiCoreV1PodTemplateSpec.from_dict(replica["template"])
        assert pod.to_dict() == replica["template"]
    # what Katib's webhook checks: types, the objective, every placeholder declared and every reference known
    assert {p["parameterType"] for p in spec["parameters"]} <= {"double", "int", "discrete", "categorical"}
    assert spec["objective"] == {"type": "maximize", "objectiveMetricName": "auc",
                                 "additionalMetricNames": ["logloss"]}
    assert spec["metricsCollectorSpec"]["collector"]["kind"] == "StdOut"
    used = set(re.findall(r"\$\{trialParameters\.([^}]+)\}", json.dumps(template["trialSpec"])))
    declared = {p["name"]: p["reference"] for p in template["trialParameters"]}
    assert used == set(declared)
    names = {p["name"] for p in spec["parameters"]}
    assert {r for r in declared.values() if not r.startswith("${trialSpec.")} == names
    lr = next(p for p in spec["parameters"] if p["name"] == "lr")
    assert lr["feasibleSpace"] == {"min": "0.0003", "max": "0.01", "distribution": "logUniform"}
    master = template["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert master["name"] == template["primaryContainerName"]


def test_katib_trial_args_with_values_substituted_train_the_picked_config(space):
    experiment = katib_experiment("ctr-hpt", "img:1", TRAIN, space, trials=8, parallel=2, num_nodes=1,
                                  gpus_per_node=1)
    names = {p.key: p_spec["name"] for p, p_spec in zip(space.params, experiment["spec"]["parameters"])}
    values = {names[key]: text for key, (text, _value) in PICKED.items()} | {"trialName": "ctr-hpt-abc12"}
    container = experiment["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]
    args = container["template"]["spec"]["containers"][0]["args"]
    substituted = [re.sub(r"\$\{trialParameters\.([^}]+)\}", lambda m: values[m.group(1)], a) for a in args]
    config = train_config(substituted[substituted.index("train") + 1:])
    assert config.out == "/mnt/ckpt/ctr-hpt-abc12"
    for key, (_text, value) in PICKED.items():
        assert config.flat()[key] == value, key
    assert substituted[substituted.index("--report-metrics") + 1] == "katib"


@pytest.mark.parametrize("entry,train,message", [
    ({"freq_threshold": {"low": 2, "high": 8}}, TRAIN, "freq_threshold cannot be searched by a managed service"),
    ({"shuffle": {"choices": [True, False]}}, TRAIN, "data.shuffle is a yes/no field"),
    ({"lr": {"low": 0.001, "high": 0.01}}, TRAIN[:2], "each trial writes DIR/<trial>"),
])
def test_specs_refuse_what_a_trial_cannot_do(entry, train, message):
    space = parse_space(entry, "space.yaml")
    for build in (vertex_tuning_job, katib_experiment):
        with pytest.raises(UserError, match=re.escape(message)):
            build("ctr-hpt", "img", train, space, 4, 2, 1, 0)


def test_cli_writes_both_kinds_and_refuses_bad_counts(tmp_path, capsys):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    for kind in ("vertex-hpt", "katib"):
        out = tmp_path / f"{kind}.yaml"
        assert main(["pipeline", "launch-spec", "--kind", kind, "--space", str(space), "--trials", "8",
                     "--parallel", "2", "--out", str(out), "--", *TRAIN]) == 0
        written = yaml.safe_load(out.read_text())
        assert (written.get("maxTrialCount") or written["spec"]["maxTrialCount"]) == 8
    for bad, message in ((["--parallel", "9"], "--parallel 9 must be between 1 and --trials 8"),
                         ([], "needs --space FILE")):
        with_space = [] if not bad else ["--space", str(space)]
        argv = ["pipeline", "launch-spec", "--kind", "katib", "--trials", "8", *with_space, *bad, "--", *TRAIN]
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
