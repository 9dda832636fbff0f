"""`ctrflow export`: a checkpoint and its vocabularies -> a validated Triton model repository.

    REPO/NAME/config.pbtxt, 1/                    ensemble: raw columns -> probability
    REPO/NAME_preprocess/config.pbtxt, 1/model.py, 1/vocab/, 1/schema.json
    REPO/NAME_model/config.pbtxt, 1/model.onnx    (1/model.pt with --backend pytorch,
                                                   1/model.py + 1/checkpoint/ with --backend python)
    REPO/requirements.txt, REPO/validation.json
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ctrflow import __version__
from ctrflow.errors import UserError
from ctrflow.export import python_backend, triton
from ctrflow.export.validate import check_repository, compare_with_trained
from ctrflow.serve.preprocess import copy_vocabularies
from ctrflow.serve.ranking import save_ranking_model
from ctrflow.tracking import NullTracker, Tracker

__all__ = ["export"]

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
REQUIREMENTS = """\
# Python packages the repository's python-backend models import, for the Triton image.
# They also import ctrflow {version} itself: pip install <a ctrflow checkout> (see docker/).
numpy>=1.24
pandas>=2.0
pyarrow>=14
"""


def _write_ranking(model, schema, meta, repo: Path, name: str, backend: str) -> None:
    version = repo / triton.ranking_name(name) / triton.VERSION
    if backend == "onnxruntime":
        from ctrflow.export.onnx_model import export_onnx

        export_onnx(model, schema.features, version / triton.MODEL_FILES[backend])
    elif backend == "pytorch":
        from ctrflow.export.torchscript import export_torchscript

        export_torchscript(model, schema.features, version / triton.MODEL_FILES[backend])
    else:
        python_backend.copy_template("ranking", version)
        save_ranking_model(model, schema, meta, version / "checkpoint")


def write_repository(model, schema, meta, data: str | os.PathLike, repo: Path, name: str, backend: str,
                     max_batch_size: int, instance_kind: str) -> None:
    """Write the three models of ensemble `name` and their configs into `repo`."""
    features = schema.features
    configs = [triton.ensemble_config(name, features, max_batch_size, backend),
               triton.preprocess_config(name, features, max_batch_size),
               triton.ranking_config(name, features, backend, max_batch_size, instance_kind)]
    for config in configs:
        triton.write_config(config, repo / config.name)
    (repo / name / triton.VERSION).mkdir(parents=True)  # an ensemble's version directory stays empty
    pre = repo / triton.preprocess_name(name) / triton.VERSION
    python_backend.copy_template("preprocess", pre)
    copy_vocabularies(data, pre)
    _write_ranking(model, schema, meta, repo, name, backend)


def publish(staging: Path, repo: Path, name: str) -> None:
    """Move a validated ensemble into `repo`, replacing its earlier version; other models stay."""
    repo.mkdir(parents=True, exist_ok=True)
    for model in (name, triton.preprocess_name(name), triton.ranking_name(name)):
        shutil.rmtree(repo / model, ignore_errors=True)
        os.replace(staging / model, repo / model)
    os.replace(staging / "validation.json", repo / "validation.json")
    # requirements.txt serves the whole repository, which may hold ensembles exported earlier
    torch_models = list(repo.glob(f"*/{triton.VERSION}/checkpoint/model.pt"))
    extra = "torch>=2.4  # the python-backend ranking models\n" if torch_models else ""
    (repo / "requirements.txt").write_text(REQUIREMENTS.format(version=__version__) + extra)


def read_auc(metrics: str | os.PathLike) -> float:
    """The `auc` of evaluate's `metrics.json` (the file, or the directory holding it); UserError
    naming the file when it is missing, not JSON, or has no AUC in [0, 1]."""
    path = Path(metrics)
    path = path / "metrics.json" if path.is_dir() else path
    try:
        value = json.loads(path.read_text()).get("auc")
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"--metrics {path}: not a readable metrics.json ({err})") from None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise UserError(f"--metrics {path}: field auc must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_args(name: str, max_batch_size: int, validation_rows: int) -> None:
    if not NAME_PATTERN.match(name):
        raise UserError(f"--name {name!r}: use letters, digits, '_', '-' or '.'")
    if max_batch_size <= 0:
        raise UserError(f"--max-batch-size must be positive, got {max_batch_size}")
    if validation_rows <= 0:
        raise UserError(f"--validation-rows must be positive, got {validation_rows}")


def export(checkpoint: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, name: str,
           backend: str = "onnxruntime", max_batch_size: int = 4096, instance_kind: str = "cpu",
           validation_rows: int = 4096, metrics: str | os.PathLike | None = None,
           tracker: Tracker | None = None) -> dict:
    """Export `checkpoint` as the Triton ensemble `name` into the repository `out`; returns a summary.

    The ensemble is written and validated in a staging directory and moved into `out` only when
    every config parses and the exported model matches the trained one within 1e-5 on held-out
    rows; otherwise `UserError` says why and `out` is left as it was. `metrics` (evaluate's
    `metrics.json` for this checkpoint) puts its AUC on the registered version, where
    `ctrflow promote` reads it.
    """
    from ctrflow.predict import load_for_data

    _check_args(name, max_batch_size, validation_rows)
    auc = None if metrics is None else read_auc(metrics)
    tracker = tracker or NullTracker()
    model, schema, meta = load_for_data(checkpoint, data)
    repo = Path(out)
    staging = repo.parent / f".{repo.name}.{name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_repository(model, schema, meta, data, staging, name, backend, max_batch_size, instance_kind)
        check_repository(staging, name)
        validation = {"name": name, **compare_with_trained(staging, name, backend, model, schema.features, data,
                                                            validation_rows, batch_size=min(max_batch_size, 1024))}
        (staging / "validation.json").write_text(json.dumps(validation, indent=2) + "\n")
        if not validation["passed"]:
            raise UserError(f"{name}: exported model differs from the trained one by "
                            f"{validation['max_abs_diff']:.3g} (> {validation['tolerance']:g}) on held-out rows")
        publish(staging, repo, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    configs = check_repository(repo, name)
    summary = {"repository": str(repo), "name": name, "backend": backend, "models": sorted(configs),
               "max_abs_diff": validation["max_abs_diff"], "rows": validation["rows"]}
    if auc is not None:
        summary["auc"] = auc
    _track(tracker, summary, checkpoint, data, schema, max_batch_size, instance_kind)
    return summary


def _track(tracker: Tracker, summary: dict, checkpoint, data, schema, max_batch_size: int,
           instance_kind: str) -> None:
    """Params, metrics, and a registered model version (alias `candidate`) whose artifact is the
    raw-rows pyfunc carrying the Triton repository (`model/artifacts/triton/`); the version is
    tagged with the evaluation's `auc` when the export was given one."""
    tracker.log_params({"name": summary["name"], "backend": summary["backend"], "checkpoint": str(checkpoint),
                        "data": str(data), "max_batch_size": max_batch_size, "instance_kind": instance_kind})
    tracker.set_tags({"schema_hash": schema.vocab_hash})
    tracker.log_metrics({"export_max_abs_diff": summary["max_abs_diff"], "export_rows": summary["rows"]})
    if tracker.run_id is None:  # tracking off: nothing to register (and mlflow may be absent)
        return
    from ctrflow.registry import log_pyfunc

    artifact_path = log_pyfunc(tracker, checkpoint, data, repository=summary["repository"])
    tags = {"backend": summary["backend"], "max_abs_diff": f"{summary['max_abs_diff']:.3g}",
            "schema_hash": schema.vocab_hash, "checkpoint": str(checkpoint)}
    if "auc" in summary:
        tags["auc"] = repr(summary["auc"])  # full precision: promote compares it with other versions
    version = tracker.register_model(
        summary["name"], artifact_path, tags=tags,
        description=f"ctrflow export of {checkpoint}: Triton ensemble {summary['name']} "
                    f"({summary['backend']}) and a pyfunc scoring raw rows")
    if version is not None:
        summary["registered_version"] = version
