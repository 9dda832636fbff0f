"""Optimizers: dense (Adam/AdamW/SGD) for the MLPs, sparse per table (`ctrflow.embedding.optimizers`);
the DLRM learning-rate schedule (linear warmup, then polynomial decay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ctrflow.config import OptimConfig
from ctrflow.embedding.optimizers import KINDS, SparseOptimizer
from ctrflow.models import split_parameters

if TYPE_CHECKING:
    from ctrflow.accel.fused import FusedTables

DENSE_OPTIMIZERS = ("adam", "adamw", "sgd")
SPARSE_OPTIMIZERS = ("auto", *KINDS)
IMPLEMENTATION = ("fused", "foreach", "capturable")  # param-group flags that choose kernels, not results


@dataclass
class Optimizers:
    """The dense optimizer and the sparse one (`SparseOptimizer`, one kind per table), stepped together.

    `sparse_names` lists this process's table parameters (`"<collection path>.<table name>"`); the
    sparse state is saved as whole tables by table name, whatever the parameter order or sharding.
    """

    dense: torch.optim.Optimizer
    sparse: torch.optim.Optimizer | None
    sparse_names: list[str]
    base_lrs: tuple[float, float]  # (dense, sparse) before the schedule's factor
    fused: "FusedTables | None" = None  # fused tables step themselves in backward; lr and state here

    def zero_grad(self) -> None:
        """Drop gradients (sparse gradients cannot be zeroed in place)."""
        for opt in self.stepped():
            opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Apply one update to every parameter. A sparse optimizer holding no table of this process
        (every table fused, or no local shard) only counts the step, which checkpoints record."""
        for opt in self.stepped():
            opt.step()
        if self.sparse is not None and not self.sparse_names:
            self.sparse.steps += 1

    def stepped(self) -> list[torch.optim.Optimizer]:
        """The optimizers that hold parameters of this process."""
        return [o for o in (self.dense, self.sparse if self.sparse_names else None) if o is not None]

    def set_lr_factor(self, factor: float) -> None:
        """Scale both base learning rates by the schedule's `factor`."""
        for opt, base in zip((self.dense, self.sparse), self.base_lrs):
            if opt is not None:
                for group in opt.param_groups:
                    group["lr"] = base * factor
        if self.fused is not None:
            self.fused.set_lr(self.base_lrs[1] * factor)

    def state_dict(self) -> dict[str, Any]:
        """Dense state as torch saves it; sparse state as whole tables by name (topology-independent;
        collective when tables are sharded)."""
        state = self.header()
        state["sparse"]["tables"] = {
            name: {k: v for k in self.state_keys(name) if (v := self.whole_state(name, k)) is not None}
            for name in state["sparse"].get("kinds", {})}
        return state

    def header(self) -> dict[str, Any]:
        """`state_dict()` without the tables' state (small: dense state, sparse step count, lr, kinds).
        One format for plain and fused tables: checkpoints cross paths."""
        sparse = self.sparse.header() if self.sparse else {}
        if self.fused is not None:
            sparse["kinds"] = {**sparse.get("kinds", {}), **self.fused.table_kinds}
        return {"dense": self.dense.state_dict(), "sparse": sparse}

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The state tensors of table `name` (by table name, whichever optimizer steps it)."""
        return self._stepper(name).state_keys(name)

    def whole_state(self, name: str, key: str) -> torch.Tensor | None:
        """One state tensor of one whole table on the CPU (collective when sharded; see `SparseOptimizer`)."""
        return self._stepper(name).whole_state(name, key)

    def _stepper(self, name: str):
        for opt in (self.fused, self.sparse):
            if opt is not None and name in opt.table_kinds:
                return opt
        raise KeyError(f"no optimizer steps table {name}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`, on any number of processes."""
        # the saver's implementation flags (fused on its GPU, capturable in its graph) are not ours:
        # ours decide where the step counts land, and a CPU resume of a GPU run must not go fused
        dense = dict(state["dense"])
        dense["param_groups"] = [{**saved, **{k: group[k] for k in IMPLEMENTATION if k in group}}
                                 for saved, group in zip(dense["param_groups"], self.dense.param_groups)]
        self.dense.load_state_dict(dense)
        if self.sparse is not None:
            self.sparse.load_state_dict(state["sparse"])
        if self.fused is not None:
            self.fused.load_state_dict(state["sparse"])


def build_optimizers(model: nn.Module, cfg: OptimConfig, fused: "FusedTables | None" = None) -> Optimizers:
    """The dense and sparse optimizers `cfg` names, over `model`'s parameters (fused tables, which
    have none, step themselves: `fused` carries their learning rate and state)."""
    dense_params, tables = split_parameters(model)
    sparse_lr = cfg.lr if cfg.sparse_lr is None else cfg.sparse_lr
    # torch's one-kernel Adam where every dense parameter is on the GPU (a few launches per group of
    # tensors otherwise); same state keys, so checkpoints cross devices
    one_kernel = (bool(dense_params) and all(p.is_cuda for p in dense_params)) or None
    if cfg.dense == "adam":
        dense = torch.optim.Adam(dense_params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=one_kernel)
    elif cfg.dense == "adamw":
        dense = torch.optim.AdamW(dense_params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=one_kernel)
    elif cfg.dense == "sgd":
        dense = torch.optim.SGD(dense_params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        raise ValueError(f"unknown dense optimizer {cfg.dense!r}; choose one of {', '.join(DENSE_OPTIMIZERS)}")
    # per table: SGD, row-wise Adagrad, Adam or LazyAdam (auto: LazyAdam on large tables, Adam on small)
    sparse = SparseOptimizer(model, cfg.sparse, lr=sparse_lr, large_table_rows=cfg.large_table_rows,
                             l2=cfg.embedding_l2)
    return Optimizers(dense, sparse, list(tables), (cfg.lr, sparse_lr), fused)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int, epoch_steps: int) -> float:
    """DLRM schedule: linear warmup over `warmup_steps`, flat, then polynomial decay from
    `decay_start_step` (None: the end of epoch `decay_start_epoch`, `epoch_steps` steps each; both None:
    no decay) over `decay_steps` (0: until `total_steps`) down to `min_lr_factor`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    start = decay_start(cfg, epoch_steps)
    if start is None or step < start:
        return 1.0
    span = cfg.decay_steps or max(total_steps - start, 1)
    remaining = max(0.0, 1.0 - (step - start) / span)
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * remaining ** cfg.decay_power


def decay_start(cfg: OptimConfig, epoch_steps: int) -> int | None:
    """The step the learning-rate decay starts at: `decay_start_step`, else the end of epoch
    `decay_start_epoch`; None: no decay."""
    if cfg.decay_start_step is not None:
        return cfg.decay_start_step
    if cfg.decay_start_epoch is None:
        return None
    return cfg.decay_start_epoch * epoch_steps
