"""The fused GPU path inside `ctrflow train`: which runs take it, the swap, and its optimizer state.

One process on a CUDA GPU (with Triton) trains its embedding collections as
`FusedEmbeddingCollection`s, which apply their own optimizer step in backward, so the loop builds
no sparse optimizer for them; DLRM's interaction becomes `FusedDotInteraction`. Under torchrun
each rank holds its shards in a `FusedShardedEmbeddingCollection` (the same kernels behind the
all-to-all; `parallelize(..., fused=sharded_options(...))`). `ctrflow.accel.plan` decides and
`ctrflow.accel.accelerate` applies both; the swaps act on the model's named parts (`embeddings`,
`linear_embeddings`, `interaction`). The swap keeps the tables' names and values, so checkpoints hold whole tables and optimizer state in the plain
`SparseOptimizer`'s format, and load on any path (CPU, fused, N processes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ctrflow.config import OptimConfig, TrainConfig
from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.fused import FusedEmbeddingCollection, ops
from ctrflow.accel.interaction import FusedDotInteraction
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.errors import UserError
from ctrflow.models.layers import DotInteraction

if TYPE_CHECKING:
    from ctrflow.models import RankingModel
    from ctrflow.runtime import Runtime

# plain --sparse-optimizer -> (fused kernel's rule, the plain kind whose state format it shares);
# "auto" on the fused path is LazyAdam for every table (the fused Adam touches only seen rows)
FUSED_KINDS = {"sgd": ("sgd", "sgd"), "adagrad": ("rowwise_adagrad", "adagrad"),
               "lazy_adam": ("adam", "lazy_adam"), "auto": ("adam", "lazy_adam")}
# the backward's one-hot pre-reduction is a tensor-core product: collections of at least 16 columns fuse
FUSED_MIN_DIM = 16
FUSED_COLLECTIONS = (FusedEmbeddingCollection, FusedShardedEmbeddingCollection)
_STATE = {"sgd": {}, "adagrad": {"sum": "state1"}, "lazy_adam": {"exp_avg": "state1", "exp_avg_sq": "state2"}}


def use_fused(config: TrainConfig, runtime: Runtime) -> bool:
    """`--embedding auto`: fused on a CUDA GPU with Triton (under torchrun: each rank's shards,
    unless the plan has column-wise tables); `fused` insists (off CUDA the fused collection runs its
    torch version, slowly); `plain` never."""
    if config.embedding == "plain":
        return False
    column = runtime.distributed and _plans_columns(config)
    if config.embedding == "fused":
        if column:
            raise UserError("--embedding fused: column-wise sharding is not fused; use --embedding plain "
                            "or another --sharding/--plan")
        if config.optim.sparse not in FUSED_KINDS:
            raise UserError(f"--embedding fused: --sparse-optimizer {config.optim.sparse} is not fused; "
                            f"choose one of {', '.join(FUSED_KINDS)}")
        return True
    if config.embedding != "auto":
        raise UserError(f"--embedding must be auto, fused or plain, got {config.embedding!r}")
    fast = runtime.device.type == "cuda" and ops.triton is not None and not column
    return fast and config.optim.sparse in FUSED_KINDS


def _plans_columns(config: TrainConfig) -> bool:
    """Whether `--sharding`/`--plan` asks for column-wise tables."""
    if config.sharding == "column":
        return True
    if not config.plan:
        return False
    from ctrflow.embedding.plan import read_plan_overrides

    return any((spec if isinstance(spec, str) else spec.get("sharding")) == "column"
               for spec in read_plan_overrides(config.plan).values())


def sharded_options(cfg: OptimConfig, output_dtype: torch.dtype | None) -> dict[str, Any]:
    """Options of the fused sharded collections under torchrun (`parallelize(..., fused=...)`)."""
    return {"optimizer": FUSED_KINDS[cfg.sparse][0], "lr": cfg.lr if cfg.sparse_lr is None else cfg.sparse_lr,
            "output_dtype": output_dtype or torch.float32, "l2": cfg.embedding_l2}


def swap_interactions(model: RankingModel) -> None:
    """DLRM's dot interaction (`model.interaction`) becomes the fused one (same function, no weights),
    where the model has a dense arch and tables: the fused kernel reads the dense vector as the first
    of the interacting features, beside at least one embedding."""
    inter = model.interaction
    if type(inter) is DotInteraction and inter.dense and inter.num_features > 1:
        model.interaction = FusedDotInteraction.from_plain(inter)


def fused_collections(model: RankingModel) -> dict[str, nn.Module]:
    """The collections of `model` (`embeddings`, `linear_embeddings`) that train themselves (fused,
    sharded or not), by attribute name."""
    parts = {"embeddings": model.embeddings, "linear_embeddings": model.linear_embeddings}
    return {path: coll for path, coll in parts.items() if isinstance(coll, FUSED_COLLECTIONS)}


def apply_fused(model: RankingModel, cfg: OptimConfig, device: torch.device, output_dtype: torch.dtype | None,
                host: dict[str, int] | None = None) -> dict[str, FusedEmbeddingCollection]:
    """Swap, in place, the model's plain collections (`embeddings`, `linear_embeddings`) of dim >=
    `FUSED_MIN_DIM` for fused ones on `device` (same tables, one-id and multi-hot alike, same weights; a
    collection without tables stays as it is; the tables in `host` {table: cache rows} in host memory)
    and a DLRM dot interaction for the fused one; returns the fused collections by attribute name."""
    rule = FUSED_KINDS[cfg.sparse][0]
    lr = cfg.lr if cfg.sparse_lr is None else cfg.sparse_lr
    fused = {}
    for path in ("embeddings", "linear_embeddings"):
        coll = getattr(model, path)
        if isinstance(coll, EmbeddingCollection) and coll.tables and coll.embedding_dim >= FUSED_MIN_DIM:
            mine = {t.name: host[t.name] for t in coll.tables if t.name in (host or {})}
            fused[path] = FusedEmbeddingCollection.from_collection(
                coll, optimizer=rule, lr=lr, device=device, output_dtype=output_dtype or torch.float32,
                check_ids=False, l2=cfg.embedding_l2, host=mine)  # the loader checked every id on the host
            setattr(model, path, fused[path])
    swap_interactions(model)
    return fused


class FusedTables:
    """The optimizer face of the fused collections: learning rate, and state in `SparseOptimizer`'s
    format (`table_kinds`; `whole_state` of one table and key, as checkpoints write it table by
    table; `load_state_dict`), so checkpoints cross paths."""

    def __init__(self, collections: dict[str, nn.Module], sparse: str):
        self.collections = collections
        self.kind = FUSED_KINDS[sparse][1]
        self._owner = {t.name: coll for coll in collections.values() for t in coll.tables}
        self.table_kinds = {name: self.kind for name in self._owner}

    def set_lr(self, lr: float) -> None:
        """Learning rate of the next steps (a device write, no sync)."""
        for coll in self.collections.values():
            coll.set_lr(lr)

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The state tensors every fused table keeps, in the plain kind's names."""
        return tuple(_STATE[self.kind])

    def whole_state(self, name: str, key: str) -> torch.Tensor:
        """One state tensor of one whole table, on the CPU (collective when the tables are sharded)."""
        return self._owner[name].table_state(name, _STATE[self.kind][key])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the sparse part of `Optimizers.state_dict()` (or of a checkpoint, tables mapped on demand),
        written on any path (names a table or kind that differs)."""
        for coll in self.collections.values():
            for t in coll.tables:
                saved_kind = state["kinds"].get(t.name)
                if saved_kind != self.kind:
                    raise UserError(f"table {t.name}: checkpoint used {saved_kind}, this run {self.kind} "
                                    "(fused tables: auto means lazy_adam)")
            coll.load_table_states(_STATE[self.kind], state["tables"], state.get("steps", 0))
