"""`ctrflow export`: a checkpoint and its vocabularies -> a validated Triton model repository.

    REPO/NAME/config.pbtxt, 1/                    ensemble: raw columns -> probability, pinned to version k
    REPO/NAME_preprocess/config.pbtxt, k/model.py, k/vocab/, k/schema.json
    REPO/NAME_model/config.pbtxt, k/model.onnx    (k/model.pt with --backend pytorch, k/model.py with
                                                   --backend python), k/checkpoint/ (the weights),
                                                   k/delta/ (from k-1, when exported with --base)
    REPO/requirements.txt, REPO/validation.json   (of the newest version)

A first export writes version 1; `--base REPO` writes the next version beside the served one
(`ctrflow.export.incremental`), with the delta from it (`ctrflow.export.delta`), and keeps the
newest `--keep-versions`. `ctrflow.export.versions` says why the ensemble pins one version pair.
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


def _write_ranking(model, schema, meta, version: Path, backend: str) -> None:
    if backend == "onnxruntime":
        from ctrflow.export.onnx_model import export_onnx

        export_onnx(model, schema.features, version / triton.MODEL_FILES[backend])
    elif backend == "pytorch":
        from ctrflow.export.torchscript import export_torchscript

        export_torchscript(model, schema.features, version / triton.MODEL_FILES[backend])
    else:
        python_backend.copy_template("ranking", version)
    # every backend keeps the weights: the python backend serves them, and the next
    # `--base` export takes its delta against them
    save_ranking_model(model, schema, meta, version / "checkpoint")


def write_configs(repo: Path, name: str, features, backend: str, max_batch_size: int, instance_kind: str,
                  version: int) -> list:
    """Write the three models' `config.pbtxt` into `repo`, the ensemble pinned to `version`."""
    configs = [triton.ensemble_config(name, features, max_batch_size, backend, version),
               triton.preprocess_config(name, features, max_batch_size),
               triton.ranking_config(name, features, backend, max_batch_size, instance_kind)]
    for config in configs:
        triton.write_config(config, repo / config.name)
    (repo / name / triton.VERSION).mkdir(parents=True, exist_ok=True)  # an ensemble's version folder stays empty
    return configs


def write_version(model, schema, meta, data: str | os.PathLike, repo: Path, name: str, backend: str,
                  version: int) -> None:
    """Write version `version` of the preprocess (its vocabularies) and of the ranking model into `repo`."""
    pre = repo / triton.preprocess_name(name) / str(version)
    python_backend.copy_template("preprocess", pre)
    copy_vocabularies(data, pre)
    _write_ranking(model, schema, meta, repo / triton.ranking_name(name) / str(version), backend)


def write_repository(model, schema, meta, data: str | os.PathLike, repo: Path, name: str, backend: str,
                     max_batch_size: int, instance_kind: str) -> None:
    """Write the three models of ensemble `name` and their configs into `repo`, as version 1."""
    write_configs(repo, name, schema.features, backend, max_batch_size, instance_kind, int(triton.VERSION))
    write_version(model, schema, meta, data, repo, name, backend, int(triton.VERSION))


def write_requirements(repo: Path) -> None:
    """`requirements.txt` for the whole repository, which may hold ensembles exported earlier."""
    configs = [triton.read_config(p) for p in repo.glob("*/config.pbtxt")]
    python_ranking = any(c.backend == "python" and any(repo.glob(f"{c.name}/*/checkpoint/model.pt")) for c in configs)
    extra = "torch>=2.4  # the python-backend ranking models\n" if python_ranking else ""
    (repo / "requirements.txt").write_text(REQUIREMENTS.format(version=__version__) + extra)


def publish(staging: Path, repo: Path, name: str) -> None:
    """Move a validated ensemble into `repo`, replacing its earlier versions; other models stay."""
    repo.mkdir(parents=True, exist_ok=True)
    for model in (name, triton.preprocess_name(name), triton.ranking_name(name)):
        shutil.rmtree(repo / model, ignore_errors=True)
        os.replace(staging / model, repo / model)
    os.replace(staging / "validation.json", repo / "validation.json")
    write_requirements(repo)


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


REPOSITORY_FILES = ("requirements.txt", "validation.json")  # besides model folders, what export writes at the top


def is_model_folder(path: Path) -> bool:
    """A Triton model: a folder with `config.pbtxt` or a numbered version folder."""
    return path.is_dir() and ((path / "config.pbtxt").is_file() or any(
        p.is_dir() and p.name.isdigit() for p in path.iterdir()))


def check_out(repo: Path) -> None:
    """Refuse, before any work, an `--out` that is a file, or a non-empty folder other than a Triton
    model repository (one holds only model folders, requirements.txt and validation.json): the
    ensemble is added to a repository (replacing its earlier version), never merged into other files."""
    if repo.exists() and not repo.is_dir():
        raise UserError(f"--out {repo}: is a file; give a folder for the Triton model repository")
    if not repo.is_dir():
        return
    for entry in sorted(repo.iterdir()):
        if entry.name.startswith(".") or (entry.is_file() and entry.name in REPOSITORY_FILES):
            continue
        if not is_model_folder(entry):
            raise UserError(f"--out {repo}: not empty and not a Triton model repository ({entry.name} is not a "
                            f"model folder with config.pbtxt); give a new or empty folder, or a repository to add "
                            f"the ensemble to")


def export(checkpoint: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike | None, name: str,
           backend: str | None = None, max_batch_size: int | None = None, instance_kind: str | None = None,
           validation_rows: int = 4096, metrics: str | os.PathLike | None = None,
           tracker: Tracker | None = None, base: str | os.PathLike | None = None,
           keep_versions: int = 2) -> dict:
    """Export `checkpoint` as the Triton ensemble `name` into the repository `out`; returns a summary.

    `out` is a new or empty folder, or a Triton model repository: the ensemble's three models are
    added to it, replacing the same ensemble's earlier version, and other models stay (`check_out`).
    The ensemble is written and validated in a staging directory and moved into `out` only when
    every config parses and the exported model matches the trained one within 1e-5 on held-out
    rows; otherwise `UserError` says why and `out` is left as it was. `metrics` (evaluate's
    `metrics.json` for this checkpoint) puts its AUC on the registered version, where
    `ctrflow promote` reads it.

    Without `base` the ensemble is written as version 1 (an earlier export of `name` in `out` is
    replaced). With `base` (a repository holding ensemble `name`; `out` defaults to it) the next
    version is added beside the one `base` serves, with the delta from it, and the newest
    `keep_versions` are kept (`ctrflow.export.incremental`). `backend`, `max_batch_size` and
    `instance_kind` default to the base's (else onnxruntime, 4096, cpu).
    """
    from ctrflow.predict import load_for_data

    if out is None and base is None:
        raise UserError("--out is required (or --base, to add a version to that repository)")
    repo = Path(out if out is not None else base)
    _check_args(name, 1 if max_batch_size is None else max_batch_size, validation_rows)
    check_out(repo)
    auc = None if metrics is None else read_auc(metrics)
    tracker = tracker or NullTracker()
    model, schema, meta = load_for_data(checkpoint, data)
    if base is not None:
        from ctrflow.export.incremental import export_next

        summary = export_next(model, schema, meta, data, Path(base), repo, name, backend=backend,
                              max_batch_size=max_batch_size, instance_kind=instance_kind,
                              validation_rows=validation_rows, keep_versions=keep_versions)
    else:
        backend, max_batch_size = backend or "onnxruntime", 4096 if max_batch_size is None else max_batch_size
        summary = _export_first(model, schema, meta, data, repo, name, backend, max_batch_size,
                                instance_kind or "cpu", validation_rows)
    if auc is not None:
        summary["auc"] = auc
    _track(tracker, summary, checkpoint, data, schema, summary["max_batch_size"], summary["instance_kind"])
    return summary


def _export_first(model, schema, meta, data, repo: Path, name: str, backend: str, max_batch_size: int,
                  instance_kind: str, validation_rows: int) -> dict:
    """Version 1 of ensemble `name`, staged, validated, then moved into `repo`."""
    staging = repo.parent / f".{repo.name}.{name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_repository(model, schema, meta, data, staging, name, backend, max_batch_size, instance_kind)
        validation = validate_staged(staging, name, backend, model, schema, data, validation_rows, max_batch_size)
        publish(staging, repo, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    configs = check_repository(repo, name)
    return {"repository": str(repo), "name": name, "backend": backend, "models": sorted(configs),
            "version": int(triton.VERSION), "max_abs_diff": validation["max_abs_diff"], "rows": validation["rows"],
            "max_batch_size": max_batch_size, "instance_kind": instance_kind}


def validate_staged(staging: Path, name: str, backend: str, model, schema, data, validation_rows: int,
                    max_batch_size: int) -> dict:
    """Check the staged repository's configs and files and compare its served ranking model with the
    trained one; writes `validation.json` there. UserError when they differ by more than 1e-5."""
    check_repository(staging, name)
    validation = {"name": name, **compare_with_trained(staging, name, backend, model, schema.features, data,
                                                        validation_rows, batch_size=min(max_batch_size, 1024))}
    (staging / "validation.json").write_text(json.dumps(validation, indent=2) + "\n")
    if not validation["passed"]:
        raise UserError(f"{name}: exported model differs from the trained one by "
                        f"{validation['max_abs_diff']:.3g} (> {validation['tolerance']:g}) on held-out rows")
    return validation


def _track(tracker: Tracker, summary: dict, checkpoint, data, schema, max_batch_size: int,
           instance_kind: str) -> None:
    """Params, metrics, and a registered model version (alias `candidate`) whose files are the
    raw-rows pyfunc carrying the Triton repository (its `artifacts/triton/`); the version is
    tagged with the evaluation's `auc` when the export was given one."""
    tracker.log_params({"name": summary["name"], "backend": summary["backend"], "checkpoint": str(checkpoint),
                        "data": str(data), "max_batch_size": max_batch_size, "instance_kind": instance_kind})
    tracker.set_tags({"schema_hash": schema.vocab_hash})
    tracker.log_metrics({"export_max_abs_diff": summary["max_abs_diff"], "export_rows": summary["rows"],
                         "export_version": summary["version"]})
    if "delta" in summary:  # on a day of new data, how much of the model changed
        tracker.log_metrics({f"delta_{k}": summary["delta"][k] for k in
                             ("delta_bytes", "full_bytes", "delta_fraction", "changed_rows", "total_rows")})
    if tracker.run_id is None:  # tracking off: nothing to register (and mlflow may be absent)
        return
    from ctrflow.registry import register_pyfunc

    tags = {"backend": summary["backend"], "max_abs_diff": f"{summary['max_abs_diff']:.3g}",
            "schema_hash": schema.vocab_hash, "checkpoint": str(checkpoint)}
    if "auc" in summary:
        tags["auc"] = repr(summary["auc"])  # full precision: promote compares it with other versions
    version = register_pyfunc(
        tracker, summary["name"], checkpoint, data, repository=summary["repository"], tags=tags,
        description=f"ctrflow export of {checkpoint}: Triton ensemble {summary['name']} "
                    f"({summary['backend']}) and a pyfunc scoring raw rows")
    if version is not None:
        summary["registered_version"] = version
