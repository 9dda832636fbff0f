"""Sparse per-table optimizers: SGD, row-wise Adagrad, Adam and LazyAdam.

Updates read the batch's gradient rows only (duplicate ids summed first): SGD, row-wise
Adagrad and LazyAdam touch only those rows; Adam decays the moments of every row, exactly like
`torch.optim.Adam` fed the dense gradient (affordable on small tables). With `l2` every touched row's
summed gradient gets `+ l2 * w` first (`ctrflow.embedding.regularize`). State lives beside each
table's local shard, so it is sharded with the table (a table in host memory: beside its rows there,
and in its device cache, `ctrflow.embedding.cache`); `state_dict()` holds whole-table state, so a
checkpoint written on N ranks loads on M.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ctrflow.embedding.collection import EmbeddingCollection
from ctrflow.embedding.regularize import regularized
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError

KINDS = ("sgd", "adagrad", "adam", "lazy_adam")
LARGE_TABLE_ROWS = 1_000  # auto: LazyAdam at or above this many rows, dense Adam below (see config/tree.py)


def choose_kind(table: TableConfig, kind: str = "auto", large_table_rows: int = LARGE_TABLE_ROWS) -> str:
    """The optimizer of one table: `kind`, or for "auto" LazyAdam on large tables and Adam on small."""
    if kind == "auto":
        return "lazy_adam" if table.num_embeddings >= large_table_rows else "adam"
    if kind not in KINDS:
        raise ValueError(f"unknown sparse optimizer {kind!r}; choose auto or one of {', '.join(KINDS)}")
    return kind


def state_bytes(table: TableConfig, kind: str) -> int:
    """Bytes of weights plus optimizer state of one table (what the sharding planner packs)."""
    extra = {"sgd": 0, "adagrad": table.num_embeddings * 4, "adam": 2 * table.bytes, "lazy_adam": 2 * table.bytes}
    return table.bytes + extra[kind]


def embedding_collections(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every embedding collection in a model, plain or sharded, by module path."""
    from ctrflow.embedding.sharded import ShardedEmbeddingCollection

    for path, module in model.named_modules():
        if isinstance(module, (EmbeddingCollection, ShardedEmbeddingCollection)):
            yield path, module


def sparse_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The embedding weights of a model (the dense optimizer takes every other parameter)."""
    return {p for _, c in embedding_collections(model) for p in c.weights.values()}


class SparseOptimizer(torch.optim.Optimizer):
    """One optimizer over the embedding tables of a model; each table has its own kind and state.

    Param groups carry `table`, `kind`, `lr`, `betas`, `eps`, `l2` (the embedding L2), `dim` (the full
    embedding dim), so LR schedulers work unchanged. Collections without local shards leave this rank with no groups.
    """

    def __init__(self, model: nn.Module, kind: str = "auto", lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, large_table_rows: int = LARGE_TABLE_ROWS, l2: float = 0.0):
        self.collections = dict(embedding_collections(model))
        groups = []
        for _path, coll in self.collections.items():
            for t in coll.tables:
                if t.name in coll.weights:
                    groups.append({"params": [coll.weights[t.name]], "table": t.name, "dim": t.embedding_dim,
                                   "kind": choose_kind(t, kind, large_table_rows)})
        self._owner = {t.name: c for c in self.collections.values() for t in c.tables}
        self.table_kinds = {t.name: choose_kind(t, kind, large_table_rows)
                            for c in self.collections.values() for t in c.tables}
        self.steps = 0  # optimizer steps taken: Adam's bias correction, the same for every table
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "l2": l2}
        if not groups:  # a rank may hold no shard at all; torch refuses an empty optimizer
            groups = [{"params": [], "table": None, "dim": 0, "kind": "sgd"}]
        super().__init__(groups, defaults)
        for group in self.param_groups:
            cache = self._cache(group["table"])
            if cache is not None:
                if group["kind"] == "adam":
                    raise UserError(f"table {group['table']}: dense adam moves every row each step; a table in "
                                    "host memory needs lazy_adam, adagrad or sgd")
                self.state[group["params"][0]] = cache.bind_state(_STATE_KEYS[group["kind"]])

    def _cache(self, name: str | None):
        """The `HostCache` of this process's part of table `name`, or None (on the device)."""
        return getattr(self._owner[name], "caches", {}).get(name) if name is not None else None

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one update to the rows each table's gradient touches."""
        loss = closure() if closure is not None else None
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                rows, values = _rows_and_values(p.grad)
                values = regularized(values, p[rows], group["l2"])  # a column shard: its own columns
                getattr(self, f"_step_{group['kind']}")(p, rows, values, group, self.state[p])
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """Sparse gradients cannot be zeroed in place: always drop them."""
        super().zero_grad(set_to_none=True)

    def _step_sgd(self, p, rows, values, group, _state):
        p.index_add_(0, rows, values, alpha=-group["lr"])

    def _step_adagrad(self, p, rows, values, group, state):
        if "sum" not in state:
            state["sum"] = torch.zeros(p.shape[0], device=p.device)
        partial = values.pow(2).sum(dim=1)
        coll = self._owner[group["table"]]
        total = coll.reduce_row_sums(group["table"], partial) if hasattr(coll, "reduce_row_sums") else partial
        acc = state["sum"][rows] + total / group["dim"]  # row-wise: mean of g^2 over the full row
        state["sum"][rows] = acc
        p.index_add_(0, rows, values / (acc.sqrt() + group["eps"]).unsqueeze(1), alpha=-group["lr"])

    def _step_adam(self, p, rows, values, group, state):
        m, v, bc1, bc2 = self._moments(p, state, group["betas"])
        b1, b2 = group["betas"]
        m.mul_(b1).index_add_(0, rows, values, alpha=1 - b1)
        v.mul_(b2).index_add_(0, rows, values * values, alpha=1 - b2)
        p.addcdiv_(m, (v / bc2).sqrt_().add_(group["eps"]), value=-group["lr"] / bc1)

    def _step_lazy_adam(self, p, rows, values, group, state):
        m, v, bc1, bc2 = self._moments(p, state, group["betas"])
        b1, b2 = group["betas"]
        m_rows = m[rows].mul_(b1).add_(values, alpha=1 - b1)
        v_rows = v[rows].mul_(b2).addcmul_(values, values, value=1 - b2)
        m[rows], v[rows] = m_rows, v_rows
        p.index_add_(0, rows, m_rows / (v_rows / bc2).sqrt_().add_(group["eps"]), alpha=-group["lr"] / bc1)

    def _moments(self, p, state, betas) -> tuple:
        if "exp_avg" not in state:
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        return state["exp_avg"], state["exp_avg_sq"], 1 - betas[0] ** self.steps, 1 - betas[1] ** self.steps

    def state_dict(self) -> dict:
        """Whole-table state by table name (collective when tables are sharded: call on every rank)."""
        tables = {}
        for name in self.table_kinds:
            tables[name] = {}
            for key in self.state_keys(name):
                whole = self.whole_state(name, key)
                if whole is not None:
                    tables[name][key] = whole
        return {**self.header(), "tables": tables}

    def header(self) -> dict:
        """Everything of `state_dict()` but the tables' state: step count, lr and each table's kind."""
        return {"steps": self.steps, "lr": self.param_groups[0]["lr"], "kinds": dict(self.table_kinds)}

    def state_keys(self, name: str) -> tuple[str, ...]:
        """The state tensors table `name`'s kind keeps ("sum"; "exp_avg", "exp_avg_sq"; none for SGD)."""
        return _STATE_KEYS[self.table_kinds[name]]

    def whole_state(self, name: str, key: str) -> torch.Tensor | None:
        """One state tensor of one whole table, on CPU (None: an unsharded table not stepped yet).

        Collective when the table is sharded: every rank calls it, holder or not, in one order.
        Checkpoints write through it one table and key at a time, so no two whole tensors coexist.
        """
        cache = self._cache(name)
        local = cache.whole_state(key) if cache is not None else next(
            (self.state.get(g["params"][0], {}) for g in self.param_groups if g["table"] == name and g["params"]),
            {}).get(key)
        gather = getattr(self._owner[name], "gather_table", None)
        if gather is not None:
            return gather(name, local, per_row=key == "sum")
        return None if local is None else local.detach().to("cpu", copy=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from whole-table state (written on any number of ranks)."""
        self.steps = int(state_dict["steps"])
        for group in self.param_groups:
            group["lr"] = state_dict["lr"]
            if not group["params"]:
                continue
            saved = state_dict["tables"].get(group["table"])
            if saved is None:
                raise ValueError(f"optimizer state has no table {group['table']}")
            if state_dict["kinds"][group["table"]] != group["kind"]:
                raise UserError(f"table {group['table']}: checkpoint used {state_dict['kinds'][group['table']]}, "
                                 f"this run {group['kind']}")
            p, coll = group["params"][0], self._owner[group["table"]]
            cache, state = self._cache(group["table"]), {}
            for key, full in saved.items():
                part = coll.local_slice(group["table"], full) if hasattr(coll, "local_slice") else full
                if cache is not None:
                    cache.load_state(key, part)
                else:
                    state[key] = part.to(p.device).clone()
            if cache is not None:  # state never stepped is zero, as a table on the device would create it
                for key in set(cache.state) - set(saved):
                    cache.load_state(key, torch.zeros_like(cache.host_state[key]))
            self.state[p] = cache.state if cache is not None else state


_STATE_KEYS = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq"),
               "lazy_adam": ("exp_avg", "exp_avg_sq")}


def _rows_and_values(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique touched rows and their summed gradients; a dense gradient touches every row."""
    if not grad.is_sparse:
        return torch.arange(grad.shape[0], device=grad.device), grad
    if grad.is_cuda:
        g = grad.coalesce()  # dedups ids: segment-sum of the duplicate rows after a stable sort
        return g.indices()[0], g.values()
    # the CPU's coalesce sorts unstably: the order it sums a row's duplicates in depends on the row
    # numbers, which differ for a table in host memory (cache slots); index_add_ sums them in batch order
    rows, inverse = torch.unique(grad._indices()[0], return_inverse=True)
    values = grad._values()
    return rows, values.new_zeros(rows.numel(), *values.shape[1:]).index_add_(0, inverse, values)


def sparse_memory(cfg):
    """Bytes one table costs with its optimizer state (what the sharding planner packs), for an
    `OptimConfig` `cfg` (its `sparse` kind and `large_table_rows`)."""
    def memory_of(table) -> int:
        return state_bytes(table, choose_kind(table, cfg.sparse, cfg.large_table_rows))

    return memory_of
