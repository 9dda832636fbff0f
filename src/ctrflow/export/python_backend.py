"""Writes the python-backend models' files: their `model.py`, vocabularies and weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ctrflow.data.schema import Schema
# what the python models run lives in ctrflow.serve (no tritonclient, no export code); these names
# are kept here for callers written against the first version of this module (ctrflow.registry)
from ctrflow.serve.preprocess import load_vocabularies, preprocess_arrays  # noqa: F401
from ctrflow.serve.ranking import load_ranking_model, probabilities  # noqa: F401

TEMPLATES = Path(__file__).resolve().parents[1] / "serve" / "models"


def copy_template(kind: str, version_dir: Path) -> Path:
    """Copy the `model.py` of `kind` ("preprocess" or "ranking") into a model version directory."""
    version_dir.mkdir(parents=True, exist_ok=True)
    target = version_dir / "model.py"
    shutil.copy2(TEMPLATES / f"{kind}_model.py", target)
    return target


def write_vocabularies(data: str | os.PathLike, version_dir: Path) -> None:
    """Copy `data/vocab/` and `data/schema.json` beside the preprocessing `model.py`."""
    data = Path(data)
    shutil.copytree(data / "vocab", version_dir / "vocab", dirs_exist_ok=True)
    shutil.copy2(data / "schema.json", version_dir / "schema.json")


def write_serving_checkpoint(model: nn.Module, schema: Schema, meta: dict, out: Path) -> Path:
    """Weights and architecture only (no optimizer state): what `serve.ranking.load_ranking_model` reads."""
    from ctrflow.train.checkpoint import model_state

    out.mkdir(parents=True, exist_ok=True)
    torch.save(model_state(model), out / "model.pt")
    schema.save(out / "schema.json")
    (out / "model.json").write_text(json.dumps(meta["model"], indent=2) + "\n")
    return out
