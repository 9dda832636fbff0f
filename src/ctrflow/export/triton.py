"""Triton model configurations, built with Triton's own protobuf and written as `config.pbtxt`.

The repository holds three models, shaped by the feature contract in schema.json:
  NAME             ensemble: one BYTES [1] input per raw column (`serve.raw_inputs`) -> probability (FP32)
  NAME_preprocess  python backend: raw columns -> dense [num_dense] FP32, sparse [slots] INT64 (saved vocabularies)
  NAME_model       onnxruntime, pytorch (libtorch) or python backend: dense, sparse -> probability [1]
Every model has a batch dimension (max_batch_size > 0); the two leaf models batch dynamically.

Versions (`ctrflow.export.versions`): the two leaf models keep numbered version folders 1, 2, ...
written together, and load the newest two (`version_policy`); the ensemble pins both of its steps
to one version number, so a request always runs a preprocess and a model exported together.
Triton refuses zero-width tensors: a dataset without dense features has no `dense` tensor at all,
one without sparse features no `sparse` (`serve.model_inputs`).
"""

from __future__ import annotations

import os
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as pb

from ctrflow.errors import UserError
from ctrflow.contract.features import Features
from ctrflow.serve import model_inputs, raw_inputs

VERSION = "1"  # the first version of every model; the ensemble's only one (its folder stays empty)
LOADED_VERSIONS = 2  # the leaf models load their newest two: the pinned pair and the one it replaces
QUEUE_DELAY_US = 100  # wait at most 0.1 ms for more requests to join a batch
BACKENDS = ("onnxruntime", "pytorch", "python")
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "pytorch": "pytorch_libtorch"}
MODEL_FILES = {"onnxruntime": "model.onnx", "pytorch": "model.pt"}  # in NAME_model/1/
DTYPES = {"dense": pb.TYPE_FP32, "sparse": pb.TYPE_INT64}
INSTANCE_KINDS = {"cpu": pb.ModelInstanceGroup.KIND_CPU, "gpu": pb.ModelInstanceGroup.KIND_GPU}


def preprocess_name(name: str) -> str:
    """The preprocessing model's name inside the ensemble `name`."""
    return f"{name}_preprocess"


def ranking_name(name: str) -> str:
    """The ranking model's name inside the ensemble `name`."""
    return f"{name}_model"


def ranking_tensor(backend: str, tensor: str, features: Features) -> str:
    """The ranking model's own name for `tensor` ("dense", "sparse" or "probability") under `backend`.

    TorchScript keeps no tensor names: the libtorch backend binds `<name>__<index>` to the index-th
    argument of forward (`model_inputs(features)`, in order) and the index-th output; every Triton
    release reads them.
    """
    if backend != "pytorch":
        return tensor
    index = 0 if tensor == "probability" else model_inputs(features).index(tensor)
    return f"{tensor}__{index}"


def _tensor(kind, name: str, data_type: int, dims: list[int]):
    return kind(name=name, data_type=data_type, dims=dims)


def _raw_inputs(features: Features) -> list[pb.ModelInput]:
    return [_tensor(pb.ModelInput, col, pb.TYPE_STRING, [1]) for col in raw_inputs(features)]


def _features(kind, features: Features, backend: str = "python") -> list:
    widths = {"dense": features.num_dense, "sparse": features.slots}
    return [_tensor(kind, ranking_tensor(backend, name, features), DTYPES[name], [widths[name]])
            for name in model_inputs(features)]


def _probability(features: Features, backend: str = "python") -> pb.ModelOutput:
    return _tensor(pb.ModelOutput, ranking_tensor(backend, "probability", features), pb.TYPE_FP32, [1])


def _batching(config: pb.ModelConfig, instance_kind: str, count: int = 1) -> pb.ModelConfig:
    config.dynamic_batching.max_queue_delay_microseconds = QUEUE_DELAY_US
    config.instance_group.add(kind=INSTANCE_KINDS[instance_kind], count=count)
    # the newest two: while the ensemble switches to a new pair, requests still pinned to the
    # previous one find it loaded
    config.version_policy.latest.num_versions = LOADED_VERSIONS
    return config


def ensemble_config(name: str, features: Features, max_batch_size: int, backend: str = "onnxruntime",
                    version: int = 1) -> pb.ModelConfig:
    """The ensemble the clients call: preprocess -> model, raw strings in, probability out; the
    ranking step maps the ensemble's tensors onto `backend`'s names for them. Both steps are
    pinned to `version`: the preprocess and the model exported together."""
    config = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=max_batch_size,
                            input=_raw_inputs(features), output=[_probability(features)])
    pre = config.ensemble_scheduling.step.add(model_name=preprocess_name(name), model_version=version)
    for col in raw_inputs(features):
        pre.input_map[col] = col
    for tensor in model_inputs(features):
        pre.output_map[tensor] = tensor
    rank = config.ensemble_scheduling.step.add(model_name=ranking_name(name), model_version=version)
    for tensor in model_inputs(features):
        rank.input_map[ranking_tensor(backend, tensor, features)] = tensor
    rank.output_map[ranking_tensor(backend, "probability", features)] = "probability"
    return config


def preprocess_config(name: str, features: Features, max_batch_size: int) -> pb.ModelConfig:
    """The python-backend model mapping raw columns to model inputs; string work runs on CPU."""
    config = pb.ModelConfig(name=preprocess_name(name), backend="python", max_batch_size=max_batch_size,
                            input=_raw_inputs(features), output=_features(pb.ModelOutput, features))
    return _batching(config, "cpu")


def ranking_config(name: str, features: Features, backend: str, max_batch_size: int,
                   instance_kind: str) -> pb.ModelConfig:
    """The ranking model: an ONNX graph on onnxruntime, TorchScript on libtorch, or the checkpoint
    on the python backend."""
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if instance_kind not in INSTANCE_KINDS:
        raise UserError(f"--instance-kind {instance_kind}: expected one of {', '.join(INSTANCE_KINDS)}")
    config = pb.ModelConfig(name=ranking_name(name), backend=backend, max_batch_size=max_batch_size,
                            input=_features(pb.ModelInput, features, backend),
                            output=[_probability(features, backend)])
    if backend in PLATFORMS:
        config.platform = PLATFORMS[backend]
        config.default_model_filename = MODEL_FILES[backend]
    return _batching(config, instance_kind)


def write_config(config: pb.ModelConfig, model_dir: str | os.PathLike) -> Path:
    """Write `model_dir/config.pbtxt` in protobuf text format."""
    path = Path(model_dir) / "config.pbtxt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text_format.MessageToString(config))
    return path


def read_config(path: str | os.PathLike) -> pb.ModelConfig:
    """Parse a `config.pbtxt` with Triton's `ModelConfig` message; UserError naming the file if it fails."""
    path = Path(path)
    try:
        return text_format.Parse(path.read_text(), pb.ModelConfig())
    except (OSError, text_format.ParseError) as err:
        raise UserError(f"{path}: not a valid Triton model config ({err})") from None
