"""Real small artifacts for the evaluate/export/predict tests: synthetic raw days, preprocessed
by `ctrflow preprocess`, and an (untrained, seeded) checkpoint written by the checkpoint code.
Built once per test session; a fake `triton_python_backend_utils` runs the python-backend
`model.py` files offline."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch

_BUILT: dict[str, Path] = {}


def processed_data(factory) -> tuple[Path, Path]:
    """(raw dir with day_0.tsv and day_1.tsv, processed dir): 600 synthetic rows a day (cached)."""
    if "data" not in _BUILT:
        from ctrflow.preprocess.run import preprocess
        from ctrflow.datasets.criteo.synth import synthesize

        root = factory.mktemp("serving-data")
        synthesize(root / "raw", rows=600, days=2, seed=3)
        preprocess([root / "raw" / "day_0.tsv"], [root / "raw" / "day_1.tsv"], root / "data",
                   freq_threshold=2, workers=1)
        _BUILT.update(raw=root / "raw", data=root / "data")
    return _BUILT["raw"], _BUILT["data"]


def movielens_data(factory, drop: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """(raw dir with day_0.csv, day_1.csv and movielens.yaml, processed dir): 800 synthetic
    movielens-like rows a day, preprocessed with their description (cached). `drop` names feature
    kinds ("dense") the description leaves out."""
    key = "movielens" + "".join(f"-{kind}" for kind in drop)
    if key not in _BUILT:
        import yaml

        from ctrflow.datasets.movielens.synth import synthesize
        from ctrflow.preprocess.run import preprocess

        root = factory.mktemp(key)
        synthesize(root / "raw", rows=800, days=2, seed=4)
        described = yaml.safe_load((root / "raw" / "movielens.yaml").read_text())
        for kind in drop:
            described[kind] = [] if kind != "multi_hot" else {}
        (root / "raw" / "described.yaml").write_text(yaml.safe_dump(described))
        preprocess([root / "raw" / "day_0.csv"], [root / "raw" / "day_1.csv"], root / "data", workers=1,
                   dataset=root / "raw" / "described.yaml")
        _BUILT.update({f"{key}-raw": root / "raw", key: root / "data"})
    return _BUILT[f"{key}-raw"], _BUILT[key]


def checkpoint(factory, model: str = "dlrm", data: Path | None = None) -> Path:
    """A seeded, untrained checkpoint of `model` for `data` (default `processed_data`), written by
    the checkpoint code."""
    key = model if data is None else f"{model}:{data}"
    if key not in _BUILT:
        from ctrflow.config import ModelConfig, TrainConfig
        from ctrflow.schema import Schema
        from ctrflow.models import build_model
        from ctrflow.checkpoint import save_checkpoint
        from ctrflow.train.distributed import Runtime
        from ctrflow.train.optim import build_optimizers

        data = data or processed_data(factory)[1]
        out = factory.mktemp(f"ckpt-{model}")
        schema = Schema.load(data)
        arch = ModelConfig(name=model, embedding_dim=4, bottom_mlp=(8,), top_mlp=(8,), deep_mlp=(8,))
        config = TrainConfig(out=str(out), model=arch)
        net = build_model(model, schema, 4, seed=1, **arch.arch_kwargs())
        with torch.no_grad():  # spread the untrained scores so that comparisons are not trivially equal
            for table in net.embeddings.weights.values():
                table.mul_(40.0)
        save_checkpoint(out, net, build_optimizers(net, config.optim), {"step": 0, "epoch": 0, "batch": 0},
                        config, schema, Runtime(0, 1, 0, torch.device("cpu")))
        _BUILT[key] = out
    return _BUILT[key]


class FakeTensor:
    """`pb_utils.Tensor`: a name and a numpy array."""

    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeRequest:
    """`pb_utils.InferenceRequest` as the backend hands it to `execute`."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = {k: FakeTensor(k, v) for k, v in tensors.items()}


class FakeError(Exception):
    """`pb_utils.TritonError`."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


class FakeResponse:
    """`pb_utils.InferenceResponse`."""

    def __init__(self, output_tensors, error=None):
        self.output_tensors, self.error = output_tensors, error

    def output(self, name: str) -> np.ndarray:
        return next(t.as_numpy() for t in self.output_tensors if t.name() == name)


def fake_pb_utils() -> types.ModuleType:
    """The subset of `triton_python_backend_utils` ctrflow's model.py files use."""
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor = FakeTensor
    module.InferenceResponse = FakeResponse
    module.TritonError = FakeError
    module.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    return module


def load_python_model(monkeypatch, model_py: Path, instance_kind: str = "CPU"):
    """Import a repository's `model.py` with the fake backend module and initialize it."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    name = f"triton_model_{model_py.parent.parent.name}"
    spec = importlib.util.spec_from_file_location(name, model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_repository": str(model_py.parent.parent), "model_version": "1",
                      "model_name": model_py.parent.parent.name, "model_instance_kind": instance_kind,
                      "model_instance_device_id": "0", "model_config": "{}"})
    return model


def raw_requests(path: Path, data: Path, rows: slice) -> dict[str, np.ndarray]:
    """Rows of a raw file of the dataset `data` was preprocessed from, as Triton BYTES inputs:
    {raw column: object array [B, 1]} (read as a client reads its files)."""
    from ctrflow.datasets.table.raw import read_raw_rows
    from ctrflow.preprocess.transform import description_of
    from ctrflow.schema import Schema

    blocks = list(read_raw_rows(path, description_of(Schema.load(data))))
    return {name: np.array([[v.encode()] for v in np.concatenate([b.columns[name].to_numpy(zero_copy_only=False)
                                                                  for b in blocks])[rows]], dtype=object)
            for name in blocks[0].columns}

