"""The fused GPU path inside `ctrflow train`: which runs take it, the swap, and its optimizer state.

One process on a CUDA GPU (with Triton) trains its embedding collections as
`FusedEmbeddingCollection`s, which apply their own optimizer step in backward, so the loop builds
no sparse optimizer for them; DLRM's interaction becomes `FusedDotInteraction`. The swap keeps the
tables' names and values, so checkpoints hold whole tables and optimizer state in the plain
`SparseOptimizer`'s format, and load on any path (CPU, fused, N processes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ctrflow.config import OptimConfig, TrainConfig
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection, ops
from ctrflow.embedding.fused.interaction import FusedDotInteraction
from ctrflow.errors import UserError
from ctrflow.models import embedding_collections, replace_module
from ctrflow.models.layers import DotInteraction
from ctrflow.train.distributed import Runtime

# plain --sparse-optimizer -> (fused kernel's rule, the plain kind whose state format it shares);
# "auto" on the fused path is LazyAdam for every table (the fused Adam touches only seen rows)
FUSED_KINDS = {"sgd": ("sgd", "sgd"), "adagrad": ("rowwise_adagrad", "adagrad"),
               "lazy_adam": ("adam", "lazy_adam"), "auto": ("adam", "lazy_adam")}
_STATE = {"sgd": {}, "adagrad": {"sum": "state1"}, "lazy_adam": {"exp_avg": "state1", "exp_avg_sq": "state2"}}


def use_fused(config: TrainConfig, runtime: Runtime) -> bool:
    """`--embedding auto`: fused for one process on a CUDA GPU with Triton; `fused` insists (one
    process; off CUDA the fused collection runs its torch version, slowly); `plain` never."""
    if config.embedding == "plain":
        return False
    if config.embedding == "fused":
        if runtime.distributed:
            raise UserError("--embedding fused needs one process: under torchrun the tables are sharded "
                            "(use --embedding plain or auto)")
        if config.optim.sparse not in FUSED_KINDS:
            raise UserError(f"--embedding fused: --sparse-optimizer {config.optim.sparse} is not fused; "
                            f"choose one of {', '.join(FUSED_KINDS)}")
        return True
    if config.embedding != "auto":
        raise UserError(f"--embedding must be auto, fused or plain, got {config.embedding!r}")
    fast = runtime.device.type == "cuda" and not runtime.distributed and ops.triton is not None
    return fast and config.optim.sparse in FUSED_KINDS


def autocast_dtype(config: TrainConfig, runtime: Runtime) -> torch.dtype | None:
    """The dense part's autocast dtype: `--precision auto` is bf16 on CUDA, fp32 (None) elsewhere."""
    if config.precision == "fp32" or (config.precision == "auto" and runtime.device.type != "cuda"):
        return None
    if config.precision not in ("auto", "bf16"):
        raise UserError(f"--precision must be auto, fp32 or bf16, got {config.precision!r}")
    return torch.bfloat16


def apply_fused(model: nn.Module, cfg: OptimConfig, device: torch.device,
                output_dtype: torch.dtype | None) -> dict[str, FusedEmbeddingCollection]:
    """Swap, in place, every plain collection of dim >= 16 for a fused one on `device` (same tables,
    same weights) and a DLRM dot interaction for the fused one; returns the fused collections by path."""
    rule = FUSED_KINDS[cfg.sparse][0]
    lr = cfg.lr if cfg.sparse_lr is None else cfg.sparse_lr
    fused = {}
    for path, coll in embedding_collections(model).items():
        # the backward's one-hot pre-reduction is a tensor-core product: at least 16 columns
        if isinstance(coll, EmbeddingCollection) and coll.tables[0].embedding_dim >= 16:
            fused[path] = FusedEmbeddingCollection.from_collection(
                coll, optimizer=rule, lr=lr, device=device, output_dtype=output_dtype or torch.float32,
                check_ids=False)  # the loader checked every id on the host
            replace_module(model, path, fused[path])
    for path, module in list(model.named_modules()):
        if type(module) is DotInteraction:
            replace_module(model, path, FusedDotInteraction.from_plain(module))
    return fused


class FusedTables:
    """The optimizer face of the fused collections: learning rate and state in `SparseOptimizer`'s
    format (`kinds`, whole-table `tables` by name, `steps`), so checkpoints cross paths."""

    def __init__(self, collections: dict[str, FusedEmbeddingCollection], sparse: str):
        self.collections = collections
        self.kind = FUSED_KINDS[sparse][1]

    def set_lr(self, lr: float) -> None:
        """Learning rate of the next steps (a device write, no sync)."""
        for coll in self.collections.values():
            coll.set_lr(lr)

    def state_dict(self) -> dict[str, Any]:
        """`{"kinds": {table: kind}, "tables": {table: {key: [rows(, D)] tensor}}}` on the CPU."""
        kinds, tables = {}, {}
        for coll in self.collections.values():
            state = coll.optimizer_state()
            for t, start in zip(coll.tables, coll.offsets.tolist()):
                kinds[t.name] = self.kind
                tables[t.name] = {key: state[src][start:start + t.num_embeddings].detach().cpu().clone()
                                  for key, src in _STATE[self.kind].items()}
        return {"kinds": kinds, "tables": tables}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`, from a checkpoint of any path (names a table or kind that differs)."""
        for coll in self.collections.values():
            current = coll.optimizer_state()
            current["hyper"][1].fill_(float(state.get("steps", 0)))
            for t, start in zip(coll.tables, coll.offsets.tolist()):
                saved_kind = state["kinds"].get(t.name)
                if saved_kind != self.kind:
                    raise UserError(f"table {t.name}: checkpoint used {saved_kind}, this run {self.kind} "
                                    "(fused tables: auto means lazy_adam)")
                for key, src in _STATE[self.kind].items():
                    current[src][start:start + t.num_embeddings].copy_(state["tables"][t.name][key])
