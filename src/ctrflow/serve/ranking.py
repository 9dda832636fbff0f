"""The ranking model as it is served: probability [B, 1] from the model inputs of the feature contract.

`ProbabilityModel` takes (dense, sparse) as a batch holds them; `served_module` wraps it for export
with only the inputs Triton gets (`ctrflow.serve.model_inputs`: a dataset without dense features
has no `dense` tensor, one without sparse features no `sparse`). The python backend serves a
weights-only checkpoint (`save_ranking_model` / `load_ranking_model`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ctrflow.errors import UserError
from ctrflow.contract.schema import Schema


class ProbabilityModel(nn.Module):
    """sigmoid(model(dense, sparse)) shaped [B, 1]: the output Triton serves as `probability`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(dense, sparse)).unsqueeze(1)  # [B] -> [B, 1]


class SparseOnlyModel(nn.Module):
    """`ProbabilityModel` of a dataset without dense features: sparse [B, slots] -> probability [B, 1]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = ProbabilityModel(model)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        # dtype and device from the ids: a traced graph records no device of its own
        dense = sparse.new_zeros((sparse.shape[0], 0), dtype=torch.float32)
        return self.inner(dense, sparse)


class DenseOnlyModel(nn.Module):
    """`ProbabilityModel` of a dataset without sparse features: dense [B, n] -> probability [B, 1]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = ProbabilityModel(model)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.inner(dense, dense.new_zeros((dense.shape[0], 0), dtype=torch.int64))


def served_module(model: nn.Module, features) -> nn.Module:
    """The module an exported graph holds: its arguments are `model_inputs(features)`, in order."""
    from ctrflow.serve import model_inputs

    inputs = model_inputs(features)
    if inputs == ("sparse",):
        return SparseOnlyModel(model).eval()
    if inputs == ("dense",):
        return DenseOnlyModel(model).eval()
    return ProbabilityModel(model).eval()


def example_inputs(features, rows: int = 2) -> tuple[torch.Tensor, ...]:
    """Valid inputs for tracing, one per `model_inputs(features)` (id 0, "missing" or padding, exists
    in every table); two rows so the batch axis is not specialised to 1."""
    from ctrflow.serve import model_inputs

    features = getattr(features, "features", features)
    tensors = {"dense": torch.zeros(rows, features.num_dense),
               "sparse": torch.zeros(rows, features.slots, dtype=torch.int64)}
    return tuple(tensors[name] for name in model_inputs(features))


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
    from ctrflow.checkpoint import load_model_state
    from ctrflow.models import build_model

    path = Path(path)
    arch = json.loads((path / "model.json").read_text())
    schema = Schema.load(path / "schema.json")
    model = build_model(arch["name"], schema, arch["embedding_dim"], seed=arch.get("seed", 0), **arch["arch"])
    load_model_state(model, torch.load(path / "model.pt", map_location="cpu", weights_only=True))
    return ProbabilityModel(model).eval()


def check_features(dense: np.ndarray | None, sparse: np.ndarray | None, features) -> None:
    """Refuse inputs the model cannot use, naming the feature (instead of an index error).

    `dense` [B, num_dense] and `sparse` [B, slots] (None where the model has no such input); every
    id must lie in its feature's table, [0, cardinality).
    """
    features = getattr(features, "features", features)
    for name, array, width in (("dense", dense, features.num_dense), ("sparse", sparse, features.slots)):
        if array is None and not width:
            continue
        if array is None or array.ndim != 2 or array.shape[1] != width:
            raise UserError(f"{name} must be [B, {width}], got {[] if array is None else list(array.shape)}")
    rows = {len(a) for a in (dense, sparse) if a is not None}
    if len(rows) > 1:
        raise UserError(f"dense and sparse hold different numbers of rows: {sorted(rows)}")
    if sparse is None:
        return
    for feature, (start, stop) in zip(features.sparse, features.slot_spans()):
        ids = sparse[:, start:stop]
        bad = (ids < 0) | (ids >= feature.cardinality)
        if bad.any():
            row, slot = (int(i) for i in np.argwhere(bad)[0])
            raise UserError(f"request row {row}: {feature.name} id {int(ids[row, slot])} is outside its "
                            f"embedding table of {feature.cardinality} rows")


def probabilities(model: ProbabilityModel, dense: np.ndarray | None, sparse: np.ndarray | None,
                  device: torch.device | str = "cpu") -> np.ndarray:
    """probability [B, 1] float32 of a `load_ranking_model` model; a None input is zero-width."""
    rows = len(dense) if dense is not None else len(sparse)
    dense = np.zeros((rows, 0), np.float32) if dense is None else dense
    sparse = np.zeros((rows, 0), np.int64) if sparse is None else sparse
    with torch.inference_mode():
        d = torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(device)
        s = torch.from_numpy(np.ascontiguousarray(sparse, dtype=np.int64)).to(device)
        return model(d, s).float().cpu().numpy()
