"""Offline validation of a Triton repository: configs parse with Triton's protobuf, the ensemble
wiring is consistent, every model has its files, and the exported ranking model reproduces the
trained one on held-out rows."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ctrflow.errors import UserError
from ctrflow.export.triton import MODEL_FILES, VERSION, preprocess_name, ranking_name, read_config
from ctrflow.export.versions import served_version

TOLERANCE = 1e-5  # fp32: the exported graph may fuse or reorder operations


def check_repository(repo: str | os.PathLike, name: str) -> dict[str, object]:
    """Parse every `config.pbtxt` under `repo` and check the ensemble `name` and the version pair it
    serves (`versions.served_version`); returns configs by model.

    Raises `UserError` naming the file and what is wrong.
    """
    repo = Path(repo)
    configs = {path.parent.name: read_config(path) for path in sorted(repo.glob("*/config.pbtxt"))}
    for model, config in configs.items():
        if config.name != model:
            raise UserError(f"{repo / model / 'config.pbtxt'}: name {config.name!r} != directory {model!r}")
    for needed in (name, preprocess_name(name), ranking_name(name)):
        if needed not in configs:
            raise UserError(f"{repo / needed}: missing config.pbtxt")
    _check_steps(repo, name, configs)
    _check_files(repo, name, configs)
    return configs


def _check_steps(repo: Path, name: str, configs: dict) -> None:
    """Every step's maps name real tensors of the model it calls."""
    ensemble = configs[name]
    for step in ensemble.ensemble_scheduling.step:
        if step.model_name not in configs:
            raise UserError(f"{repo / name / 'config.pbtxt'}: step calls unknown model {step.model_name!r}")
        called = configs[step.model_name]
        inputs, outputs = {t.name for t in called.input}, {t.name for t in called.output}
        unknown = sorted(set(step.input_map) - inputs) + sorted(set(step.output_map) - outputs)
        if unknown:
            raise UserError(f"{repo / name / 'config.pbtxt'}: step {step.model_name} maps unknown tensors {unknown}")


def _check_files(repo: Path, name: str, configs: dict) -> None:
    served = str(served_version(repo, name, configs[name]))
    version = repo / ranking_name(name) / served
    pre = repo / preprocess_name(name) / served
    needed = [pre / "model.py", pre / "vocab", pre / "schema.json"]
    backend = configs[ranking_name(name)].backend
    if backend in MODEL_FILES:
        needed.append(version / MODEL_FILES[backend])
    else:
        needed += [version / "model.py", version / "checkpoint" / "model.pt"]
    needed.append(repo / name / VERSION)  # Triton wants a version directory, even for an ensemble
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise UserError(f"repository incomplete: missing {', '.join(missing)}")


def held_out_rows(data: str | os.PathLike, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `rows` rows of the validation split, topped up from the training split, as the
    feature contract of `data/schema.json` lays them out (dense [n, num_dense], sparse [n, slots])."""
    from ctrflow.evaluate.split import iter_split

    data = Path(data)
    parts = sorted((data / "valid").glob("part-*.parquet")) + sorted((data / "train").glob("part-*.parquet"))
    dense, sparse, have = [], [], 0
    for _, d, s in iter_split(parts, labels=False, batch_rows=min(rows, 1 << 16)):
        dense.append(d)
        sparse.append(s)
        have += len(d)
        if have >= rows:
            break
    if not have:
        raise UserError(f"{data}: no rows in valid/ or train/ Parquet parts to validate the export on")
    return np.concatenate(dense)[:rows], np.concatenate(sparse)[:rows]


def exported_probabilities(repo: Path, name: str, backend: str, features, dense: np.ndarray, sparse: np.ndarray,
                           batch_size: int) -> np.ndarray:
    """probability [N] of the served version of the exported ranking model, through the code that serves it."""
    from ctrflow.serve import model_inputs

    version = repo / ranking_name(name) / str(served_version(repo, name))
    inputs = model_inputs(features)
    if backend == "onnxruntime":
        import onnxruntime as ort

        session = ort.InferenceSession(str(version / MODEL_FILES[backend]), providers=["CPUExecutionProvider"])

        def run(d: np.ndarray, s: np.ndarray) -> np.ndarray:
            given = {"dense": d, "sparse": s}
            return session.run(["probability"], {k: given[k] for k in inputs})[0]
    elif backend == "pytorch":
        import torch

        from ctrflow.export.torchscript import load_torchscript

        module = load_torchscript(version / MODEL_FILES[backend])

        def run(d: np.ndarray, s: np.ndarray) -> np.ndarray:
            given = {"dense": d, "sparse": s}
            with torch.inference_mode():
                return module(*[torch.from_numpy(given[k]) for k in inputs]).numpy()
    else:
        from ctrflow.serve.ranking import load_ranking_model, probabilities

        model = load_ranking_model(version / "checkpoint")

        def run(d: np.ndarray, s: np.ndarray) -> np.ndarray:
            return probabilities(model, d, s)
    parts = [run(dense[i:i + batch_size], sparse[i:i + batch_size]) for i in range(0, len(dense), batch_size)]
    return np.concatenate(parts).reshape(-1)


def compare_with_trained(repo: str | os.PathLike, name: str, backend: str, model, features,
                         data: str | os.PathLike, rows: int = 4096, batch_size: int = 1024) -> dict:
    """`{"max_abs_diff", "rows", ...}` between the exported and the trained model on held-out rows."""
    from ctrflow.predict import score

    dense, sparse = held_out_rows(data, rows)
    expected = score(model, dense, sparse)
    got = exported_probabilities(Path(repo), name, backend, features, dense, sparse, batch_size)
    diff = float(np.abs(got.astype(np.float64) - expected).max()) if len(expected) else 0.0
    return {"max_abs_diff": diff, "rows": int(len(expected)), "tolerance": TOLERANCE,
            "passed": diff <= TOLERANCE, "backend": backend, "batch_size": batch_size}
