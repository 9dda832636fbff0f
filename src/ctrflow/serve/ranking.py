"""The ranking model as the python backend serves it: a weights-only checkpoint, probability [B, 1]."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ctrflow.schema import Schema
from ctrflow.datasets.criteo.columns import DENSE, SPARSE
from ctrflow.errors import UserError


class ProbabilityModel(nn.Module):
    """sigmoid(model(dense, sparse)) shaped [B, 1]: the output Triton serves as `probability`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(dense, sparse)).unsqueeze(1)  # [B] -> [B, 1]


def save_ranking_model(model: nn.Module, schema: Schema, meta: dict, out: str | os.PathLike) -> Path:
    """Weights and architecture only (no optimizer state) into `out`: what `load_ranking_model` reads."""
    from ctrflow.checkpoint import model_state

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model_state(model), out / "model.pt")
    schema.save(out / "schema.json")
    (out / "model.json").write_text(json.dumps(meta["model"], indent=2) + "\n")
    return out


def load_ranking_model(path: str | os.PathLike) -> ProbabilityModel:
    """The model `save_ranking_model` saved in `path` (model.pt, model.json, schema.json), eval mode."""
    from ctrflow.models import build_model
    from ctrflow.checkpoint import load_model_state

    path = Path(path)
    arch = json.loads((path / "model.json").read_text())
    schema = Schema.load(path / "schema.json")
    model = build_model(arch["name"], schema, arch["embedding_dim"], seed=arch.get("seed", 0), **arch["arch"])
    load_model_state(model, torch.load(path / "model.pt", map_location="cpu", weights_only=True))
    return ProbabilityModel(model).eval()


def check_features(dense: np.ndarray, sparse: np.ndarray, table_sizes: list[int], features=None) -> None:
    """Refuse inputs the model cannot look up, naming the field (instead of an index error);
    `features` (the schema's `Features`) names the sparse features of the ids' slots."""
    from ctrflow.loaders.memory import check_ids

    if dense.ndim != 2 or dense.shape[1] != len(DENSE) or sparse.ndim != 2 or sparse.shape[1] != len(SPARSE):
        raise UserError(f"dense must be [B, {len(DENSE)}] and sparse [B, {len(SPARSE)}], "
                        f"got {list(dense.shape)} and {list(sparse.shape)}")
    check_ids(sparse, table_sizes, where="request", features=features)


def probabilities(model: ProbabilityModel, dense: np.ndarray, sparse: np.ndarray,
                  device: torch.device | str = "cpu") -> np.ndarray:
    """probability [B, 1] float32 of a `load_ranking_model` model."""
    with torch.inference_mode():
        d = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(device)
        s = torch.from_numpy(np.ascontiguousarray(sparse, dtype=np.int64)).to(device)
        return model(d, s).float().cpu().numpy()
