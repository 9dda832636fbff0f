"""`ctrflow export --base REPO`: the next version of an ensemble, beside the one the repository serves.

Steps, each leaving the served version intact if it fails:
1. check the base: it holds ensemble NAME, of the same architecture and features (vocabularies
   may grow), served by the same backend (a model's versions share one config);
2. remove version folders above the served one (left by an export that stopped before step 5);
3. stage version k = served + 1 of NAME_preprocess and NAME_model (model files, weights, the
   vocabularies) and the delta from version k-1 in a folder beside the repository; validate it;
4. rename the two version folders into the repository (each rename is atomic; a server polling
   the repository may load them, but nothing calls them yet);
5. replace NAME/config.pbtxt by one pinned to k: the commit point, after which the server switches
   to the new pair (`ctrflow.export.versions`);
6. delete versions older than the newest `keep_versions`.

With `out` other than `base` (a pipeline's output artifact), the base's ensemble is copied into a
staging repository, the version is added there, and the result is moved into `out`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ctrflow.errors import UserError
from ctrflow.export import triton
from ctrflow.export.delta import DELTA_DIR, compute_delta, write_delta
from ctrflow.export.versions import drop_unfinished, leaf_models, prune_versions, replace_file, served_version
from ctrflow.contract.features import Features
from ctrflow.contract.schema import Schema

INSTANCE_KIND_NAMES = {kind: name for name, kind in triton.INSTANCE_KINDS.items()}
SHAPE_ONLY = ("dropout",)  # architecture settings that leave the weights' shapes alone


@dataclass(frozen=True)
class BaseVersion:
    """The served version of ensemble `name` in the base repository, and the settings it was exported with."""

    repo: Path
    name: str
    version: int
    backend: str
    max_batch_size: int
    instance_kind: str

    @property
    def weights(self) -> Path:
        """The served ranking model's weights (`ctrflow.checkpoint.model_state` layout)."""
        return self.repo / triton.ranking_name(self.name) / str(self.version) / "checkpoint" / "model.pt"


def feature_differences(there: Features, here: Features) -> list[str]:
    """What makes two feature contracts serve different requests or feed different tables; a
    sparse feature's cardinality may differ (a vocabulary grows from day to day)."""
    diffs = []
    for kind in ("dense", "sparse"):
        a, b = getattr(there, kind), getattr(here, kind)
        if [f.name for f in a] != [f.name for f in b]:
            diffs.append(f"{kind} features {[f.name for f in a]} there, {[f.name for f in b]} here")
            continue
        for x, y in zip(a, b):
            for key in ("kind", "transform", "max_length", "pooling"):
                if getattr(x, key) != getattr(y, key):
                    diffs.append(f"feature {x.name}: {key} {getattr(x, key)} there, {getattr(y, key)} here")
    return diffs


def _architecture(meta: dict) -> dict:
    arch = {k: v for k, v in meta.get("arch", {}).items() if k not in SHAPE_ONLY}
    return {"model": meta.get("name"), "embedding_dim": meta.get("embedding_dim"), **arch}


def _resolve(option: str, given, based):
    if given is not None and given != based:
        raise UserError(f"--{option} {given}: the base repository's model is exported with {based}, and a "
                        f"Triton model's versions share one config (export without --base to start over)")
    return based


def check_base(base: Path, name: str, schema: Schema, meta: dict, backend: str | None,
               max_batch_size: int | None, instance_kind: str | None) -> BaseVersion:
    """The base's served version, after checking it is a repository of this model: UserError
    naming the difference (another ensemble name, architecture or feature set, or settings)."""
    from ctrflow.export.validate import check_repository

    if not (base / name / "config.pbtxt").is_file():
        held = sorted(p.parent.name for p in base.glob("*/config.pbtxt"))
        what = f"it holds {', '.join(held)}" if held else "no model (no */config.pbtxt)"
        raise UserError(f"--base {base}: no ensemble {name!r} ({what})")
    configs = check_repository(base, name)
    version = served_version(base, name, configs[name])
    ranking = configs[triton.ranking_name(name)]
    served = BaseVersion(base, name, version, backend=_resolve("backend", backend, ranking.backend),
                         max_batch_size=_resolve("max-batch-size", max_batch_size, ranking.max_batch_size),
                         instance_kind=_resolve("instance-kind", instance_kind,
                                                INSTANCE_KIND_NAMES[ranking.instance_group[0].kind]))
    there = Schema.load(base / triton.preprocess_name(name) / str(version) / "schema.json")
    diffs = feature_differences(there.features, schema.features)
    if diffs:
        raise UserError(f"--base {base}: ensemble {name} version {version} serves other features: {diffs[0]}"
                        + (f" (+{len(diffs) - 1} more)" if len(diffs) > 1 else ""))
    arch_file = served.weights.parent / "model.json"
    if not arch_file.is_file():
        raise UserError(f"--base {base}: {arch_file.relative_to(base)} missing (exported before versions "
                        f"had weights); export without --base to start over")
    theirs, ours = _architecture(json.loads(arch_file.read_text())), _architecture(meta["model"])
    if theirs != ours:
        keys = [k for k in ours if theirs.get(k) != ours[k]]
        raise UserError(f"--base {base}: {triton.ranking_name(name)} version {version} is another architecture: "
                        + "; ".join(f"{k} {theirs.get(k)} there, {ours[k]} here" for k in keys))
    return served


def _leaf_configs_differ(base: Path, staged: Path, name: str) -> list[str]:
    """Leaf models whose staged config differs from the base's in more than the version policy;
    the configs of the base's served models are rewritten only for the policy."""
    changed = []
    for model in leaf_models(name):
        a, b = triton.read_config(base / model / "config.pbtxt"), triton.read_config(staged / model / "config.pbtxt")
        if a == b:
            continue
        a.ClearField("version_policy")
        b.ClearField("version_policy")
        if a != b:
            fields = [f.name for f in a.DESCRIPTOR.fields if getattr(a, f.name) != getattr(b, f.name)]
            raise UserError(f"--base {base}: {model}/config.pbtxt differs from this export's in {', '.join(fields)}; "
                            f"a model's versions share one config (export without --base to start over)")
        changed.append(model)
    return changed


def add_version(model, schema: Schema, meta: dict, data, repo: Path, base: BaseVersion, validation_rows: int,
                keep_versions: int) -> dict:
    """Add the next version of `base.name` to `repo` (which holds `base`'s ensemble), steps 2-6."""
    from ctrflow.checkpoint import model_state
    from ctrflow.export import validate_staged, write_configs, write_requirements, write_version

    name = base.name
    dropped = drop_unfinished(repo, name, base.version)
    version = base.version + 1
    staging = repo.parent / f".{repo.name}.{name}.v{version}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_configs(staging, name, schema.features, base.backend, base.max_batch_size, base.instance_kind, version)
        write_version(model, schema, meta, data, staging, name, base.backend, version)
        validation = validate_staged(staging, name, base.backend, model, schema, data, validation_rows,
                                     base.max_batch_size)
        delta = compute_delta(torch.load(base.weights, map_location="cpu", weights_only=True), model_state(model))
        delta.base_version, delta.version = base.version, version
        write_delta(delta, staging / triton.ranking_name(name) / str(version) / DELTA_DIR)
        rewritten = _leaf_configs_differ(repo, staging, name)
        publish_version(staging, repo, name, version, rewritten)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_requirements(repo)
    pruned = prune_versions(repo, name, version, keep_versions)
    return {"version": version, "base_version": base.version, "validation": validation,
            "delta": delta.summary(), "pruned_versions": pruned, "dropped_unfinished": [str(p) for p in dropped]}


def publish_version(staging: Path, repo: Path, name: str, version: int, rewritten: list[str]) -> None:
    """Steps 4-5: leaf configs (only an older export's version policy), the version folders, then
    the ensemble's pin, the commit point."""
    for model in rewritten:
        replace_file(staging / model / "config.pbtxt", repo / model / "config.pbtxt")
    for model in leaf_models(name):
        os.replace(staging / model / str(version), repo / model / str(version))
    replace_file(staging / name / "config.pbtxt", repo / name / "config.pbtxt")
    replace_file(staging / "validation.json", repo / "validation.json")


def export_next(model, schema: Schema, meta: dict, data, base: Path, out: Path, name: str, backend: str | None,
                max_batch_size: int | None, instance_kind: str | None, validation_rows: int,
                keep_versions: int) -> dict:
    """The next version of ensemble `name` from the repository `base`, written into `out` (in place
    when it is `base`); returns export's summary with the version, the delta and what was pruned."""
    from ctrflow.export import publish
    from ctrflow.export.validate import check_repository

    if keep_versions < 1:
        raise UserError(f"--keep-versions must be at least 1, got {keep_versions}")
    served = check_base(base, name, schema, meta, backend, max_batch_size, instance_kind)
    if out.resolve() == base.resolve():
        added = add_version(model, schema, meta, data, out, served, validation_rows, keep_versions)
    else:
        copy = out.parent / f".{out.name}.{name}.base-{os.getpid()}"
        shutil.rmtree(copy, ignore_errors=True)
        try:
            for part in (name, *leaf_models(name)):
                shutil.copytree(base / part, copy / part, symlinks=True)
            added = add_version(model, schema, meta, data, copy, BaseVersion(copy, **{
                k: getattr(served, k) for k in ("name", "version", "backend", "max_batch_size", "instance_kind")}),
                validation_rows, keep_versions)
            publish(copy, out, name)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
    configs = check_repository(out, name)
    validation = added.pop("validation")
    return {"repository": str(out), "name": name, "backend": served.backend, "models": sorted(configs),
            **added, "max_abs_diff": validation["max_abs_diff"], "rows": validation["rows"],
            "max_batch_size": served.max_batch_size, "instance_kind": served.instance_kind}
