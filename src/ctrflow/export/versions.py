"""Model versions in a Triton repository: which pair the ensemble serves, the next number, retention.

An ensemble `NAME` of ctrflow has two leaf models, `NAME_preprocess` and `NAME_model`, whose
version folders (`1/`, `2/`, ...) are written together: version k of the preprocess holds the
vocabularies that version k of the model was trained on. The ensemble's config pins both steps to
one number (`model_version: k`), the *served version*.

Why pinned rather than both at "latest": Triton loads each model on its own, so with two
"latest" steps there would be moments (a poll between the two folders, one model loading slower
than the other) where new preprocessing feeds the old model. With a grown vocabulary that pair
looks up ids the old tables do not have (refused) or reads other values' rows (silently wrong).
A config belongs to the model, not to a version, so the ensemble keeps its one version folder
(`NAME/1/`, empty) and its config is rewritten, atomically, to pin the next pair: Triton reloads
the ensemble with the new pins and swaps it in when it is ready, while requests in flight finish
on the previous pair, which the leaf models keep loaded (`version_policy: latest 2`).

The served version is the commit point of an export: folders numbered above it are leftovers of
an export that did not finish (nothing serves them) and the next export removes them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ctrflow.errors import UserError
from ctrflow.export.triton import preprocess_name, ranking_name, read_config


def version_numbers(model_dir: str | os.PathLike) -> list[int]:
    """The numbered version folders of one model, ascending (other entries are ignored, as Triton does)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)


def leaf_models(name: str) -> tuple[str, str]:
    """The two models of ensemble `name` that hold versions: preprocess and ranking model."""
    return preprocess_name(name), ranking_name(name)


def served_version(repo: str | os.PathLike, name: str, ensemble=None) -> int:
    """The version the ensemble `name` of `repo` serves: the number both its steps are pinned to.

    Repositories exported before versions were pinned have steps at -1 ("latest"): their served
    version is the newest one both leaf models hold. `ensemble` is the parsed config, if at hand.
    """
    repo = Path(repo)
    config_path = repo / name / "config.pbtxt"
    ensemble = ensemble if ensemble is not None else read_config(config_path)
    pins = {step.model_name: int(step.model_version) for step in ensemble.ensemble_scheduling.step}
    leaves = leaf_models(name)
    if set(pins) != set(leaves):
        raise UserError(f"{config_path}: steps call {sorted(pins)}, expected {list(leaves)}")
    if len(set(pins.values())) != 1:
        raise UserError(f"{config_path}: steps pinned to different versions {pins}; "
                        f"a preprocess and a model of one export share a version number")
    pinned = next(iter(pins.values()))
    if pinned > 0:
        return pinned
    common = set(version_numbers(repo / leaves[0])) & set(version_numbers(repo / leaves[1]))
    if not common:
        raise UserError(f"{repo}: {leaves[0]} and {leaves[1]} have no version in common")
    return max(common)


def drop_unfinished(repo: str | os.PathLike, name: str, served: int) -> list[Path]:
    """Remove version folders numbered above `served`: what an export that stopped before pinning
    the ensemble left (nothing serves them). Returns what was removed."""
    removed = []
    for model in leaf_models(name):
        for number in version_numbers(Path(repo) / model):
            if number > served:
                path = Path(repo) / model / str(number)
                shutil.rmtree(path)
                removed.append(path)
    return removed


def prune_versions(repo: str | os.PathLike, name: str, served: int, keep: int) -> list[int]:
    """Keep the newest `keep` versions up to `served` of both leaf models; returns the numbers removed.

    Fewer than 2 gives up the switch without downtime: the version the running ensemble still
    pins could be gone before the server has loaded the new pair.
    """
    if keep < 1:
        raise UserError(f"--keep-versions must be at least 1, got {keep}")
    removed = set()
    for model in leaf_models(name):
        for number in version_numbers(Path(repo) / model):
            if number <= served - keep:
                shutil.rmtree(Path(repo) / model / str(number))
                removed.add(number)
    return sorted(removed)


def replace_file(source: Path, target: Path) -> None:
    """Move `source` onto `target` in one step (a reader sees the old file or the new one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)
