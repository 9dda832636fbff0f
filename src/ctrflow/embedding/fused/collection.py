"""`FusedEmbeddingCollection`: every table in one buffer, one-kernel lookup, optimizer step in backward.

One-id tables gather rows (`ops.lookup`); a collection with multi-hot tables gathers and pools its
bags in one kernel (`bags.lookup_bags`); both update in backward through the same sort / sum /
optimizer kernels (`ops.update_rows`), a padding slot getting no gradient. Tables the plan keeps in
host memory are served from caches of slots in the same buffer (`ctrflow.embedding.fused.cached`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ctrflow.embedding.collection import (EmbeddingCollection, copy_table_rows, init_rows, init_table,
                                          zero_padding_row)
from ctrflow.embedding.fused import bags, ops
from ctrflow.embedding.fused.cache import SlotCache
from ctrflow.embedding.fused.cached import CachedTables
from ctrflow.embedding.pooling import is_one_hot, slot_count, slot_tables
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError


class _FusedLookup(torch.autograd.Function):
    """ids -> embeddings; backward applies the collection's optimizer step and returns no gradient."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, anchor: torch.Tensor, collection: "FusedEmbeddingCollection"):
        ctx.collection = collection
        ctx.save_for_backward(ids)
        return ops.lookup(ids, collection.offsets, collection.weight, collection.output_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        coll = ctx.collection
        ops.update_rows(ids, coll.offsets, grad, coll.weight, coll.row_state, coll.scratch, coll.pre_reduce)
        return None, None, None


class _FusedBags(torch.autograd.Function):
    """ids [B, S] -> pooled [B, T, D]; backward applies the optimizer step to every slot's row."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, anchor: torch.Tensor, collection: "FusedEmbeddingCollection"):
        ctx.collection = collection
        out, scales = bags.lookup_bags(ids, collection.bag_layout(), collection.weight, collection.output_dtype,
                                       save_scales=ctx.needs_input_grad[1])
        ctx.save_for_backward(ids, scales)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ids, scales = ctx.saved_tensors
        coll = ctx.collection
        bags.update_bags(ids, coll.bag_layout(), grad, scales, coll.weight, coll.row_state, coll.scratch,
                         coll.pre_reduce)
        return None, None, None


class FusedEmbeddingCollection(nn.Module):
    """Drop-in for `EmbeddingCollection` (ids [B, S] -> [B, T, D], one-id tables and multi-hot bags,
    `tables`, `full_weights()`) that trains itself: the backward pass sums each distinct row's
    gradient (a bag's id: its bag's gradient, / count for mean, none for padding) and applies `optimizer`
    ("sgd", "rowwise_adagrad" or "adam", the lazy Adam of `torch.optim.SparseAdam`) in place, after
    adding `l2 * w` to each such row's sum (`ctrflow.embedding.regularize`).

    The weights are a buffer, not a parameter: dense optimizers and DDP never see them, and no
    gradient tensor is ever made. `storage_dtype` may be bf16/fp16 (updates computed in fp32);
    `output_dtype` is the lookup's dtype (bf16 halves the bytes of the output and its gradient).
    Built on CPU the weights equal `EmbeddingCollection(tables, seed)`'s; built with
    `device="cuda"` they are drawn there (same bounds, other numbers) to skip a host copy.

    `host` {table: cache rows}: those tables live in host memory (on a GPU drawn there chunk by
    chunk) with that many slots of the buffer as their cache (`cached.CachedTables`);
    `prefetch(ids)` brings a batch's rows in ahead of its lookup. `draw=False` leaves the host
    tables' rows undrawn (`from_collection` copies them in).
    """

    def __init__(self, tables: list[TableConfig], seed: int = 0, optimizer: str = "sgd", lr: float = 0.01,
                 storage_dtype: torch.dtype = torch.float32, output_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, eps: float = 1e-8,
                 betas: tuple[float, float] = (0.9, 0.999), check_ids: bool = True, pre_reduce: bool = True,
                 l2: float = 0.0, host: Mapping[str, int] | None = None, draw: bool = True):
        super().__init__()
        if optimizer not in ops.OPTIMIZERS:
            raise ValueError(f"unknown fused optimizer {optimizer!r}; choose one of {', '.join(ops.OPTIMIZERS)}")
        dims = {t.embedding_dim for t in tables}
        if len(dims) != 1:  # also refuses no tables: a collection without tables has nothing to fuse
            raise ValueError(f"a fused collection needs tables of one embedding_dim, got {sorted(dims)}")
        self.tables = list(tables)
        self.embedding_dim = dims.pop()
        self.output_dtype = output_dtype
        self.check_ids = check_ids
        self.pre_reduce = pre_reduce
        self.one_hot = is_one_hot(self.tables)
        self.slots = slot_count(self.tables)
        sizes = [t.num_embeddings for t in self.tables]
        host = dict(host or {})
        spans = [host.get(t.name, t.num_embeddings) for t in self.tables]  # a host table's slots
        starts = [0, *torch.tensor(spans).cumsum(0).tolist()[:-1]]
        device = torch.device(device or "cpu")
        self.register_buffer("offsets", torch.tensor(starts, dtype=torch.int64, device=device))
        # [S] every slot's table size: the range check of ids [B, S]
        self.register_buffer("sizes", torch.tensor([sizes[i] for i in slot_tables(self.tables)], dtype=torch.int64,
                                                   device=device), persistent=False)
        for name, tensor in bags.layout_tensors(self.tables, starts).items():
            self.register_buffer(f"bag_{name}", tensor.to(device), persistent=False)
        self.register_buffer("weight", _init_weights(self.tables, seed, storage_dtype, device, host))
        rows, dim = self.weight.shape
        # unused state is one element, not empty: kernels get a valid pointer either way
        state1 = {"rowwise_adagrad": (rows,), "adam": (rows, dim)}.get(optimizer, (1,))
        state2 = (rows, dim) if optimizer == "adam" else (1,)
        self.row_state = ops.RowState(
            optimizer, torch.tensor([lr, 0.0], device=device), torch.zeros(state1, device=device),
            torch.zeros(state2, device=device), eps, betas[0], betas[1], l2)
        self.scratch: dict = {}
        self.host = self._cache_tables(host, starts, seed, draw) if host else None

    def _cache_tables(self, host: dict[str, int], starts: list[int], seed: int, draw: bool) -> CachedTables:
        """The host tables' caches, their rows drawn into host memory where `draw`."""
        caches, columns, column = {}, {}, 0
        for index, (t, start) in enumerate(zip(self.tables, starts)):
            if t.name in host:
                cache = SlotCache(t.num_embeddings, start, host[t.name], t.pooling is not None, self._parts())
                if draw:
                    _draw_host(t, seed, index, cache.host[0], self.weight.device)
                cache.empty(self._parts())
                caches[t.name], columns[t.name] = cache, (column, column + t.length)
            column += t.length
        return CachedTables(caches, columns, self.weight.device)

    def _parts(self) -> list[torch.Tensor]:
        """The buffer's tensors with a row axis: the weights, then the optimizer state of each row."""
        st = self.row_state
        rows_of = {"sgd": [], "rowwise_adagrad": [st.state1], "adam": [st.state1, st.state2]}
        return [self.weight, *rows_of[st.optimizer]]

    @classmethod
    def from_collection(cls, plain: EmbeddingCollection, **options) -> "FusedEmbeddingCollection":
        """A fused copy of a plain collection's tables and weights (options as for the constructor)."""
        fused = cls(plain.tables, draw=False, **options)
        with torch.no_grad():  # table by table, in chunks: a deferred collection is never whole on the host
            for i, (t, start) in enumerate(zip(plain.tables, fused.offsets.tolist())):
                cache = fused.host.caches.get(t.name) if fused.host else None
                out = fused.weight[start:start + t.num_embeddings] if cache is None else cache.host[0]
                copy_table_rows(plain, i, 0, t.num_embeddings, out)
                if cache is not None:
                    cache.empty(fused._parts())
        return fused

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        st = self.row_state
        st.hyper, st.state1, st.state2 = fn(st.hyper), fn(st.state1), fn(st.state2)
        self.scratch.clear()
        if self.host is not None and any(p.device != c.used.device for p in self._parts()
                                         for c in self.host.caches.values()):
            raise ValueError("a fused collection with host tables stays on the device it was built for")
        return self

    def set_lr(self, lr: float) -> None:
        """New learning rate for the next steps (written in place: captured graphs see it too)."""
        self.row_state.hyper[0].fill_(lr)

    def bag_layout(self) -> bags.BagLayout:
        """Where the slots and tables lie in the buffer (for `bags.lookup_bags`)."""
        return bags.BagLayout(tuple(self.tables), self.bag_slot_offsets, self.bag_slot_table, self.bag_table_start,
                              self.bag_table_length, self.bag_table_mode, self.bag_table_offset)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != self.slots:
            raise ValueError(f"ids must be [B, {self.slots}], got {list(ids.shape)}")
        if self.check_ids and not _capturing(ids):
            self._check_range(ids)
        if self.host is not None and _capturing(ids):  # the step's CUDA graph: the slots `stage` puts in
            if self.host.staged is None or self.host.staged.shape != ids.shape:
                raise RuntimeError("host tables: stage(ids) a batch of this shape before capturing its step")
            ids = self.host.staged
        elif self.host is not None:
            ids = self.host.lookup_ids(ids, self._parts(), torch.is_grad_enabled())
        anchor = ids.new_empty(0, dtype=torch.float32).requires_grad_(torch.is_grad_enabled())
        return (_FusedLookup if self.one_hot else _FusedBags).apply(ids, anchor, self)

    def prefetch(self, ids: torch.Tensor, train: bool = True) -> None:
        """Bring the host tables' rows of batch `ids` [B, S] into their caches ahead of its forward
        (`cached.CachedTables`; no-op without host tables). `train`: its step updates them."""
        if self.host is not None:
            if self.check_ids:
                self._check_range(ids)
            self.host.prefetch(ids, self._parts(), train)

    def stage(self, ids: torch.Tensor, settle: bool = False) -> None:
        """Before a CUDA graph of the training step captures or replays batch `ids` [B, S]: their host
        tables' lookup (`cached.CachedTables.stage`), which the graph cannot hold, done now; the graph's
        lookup reads its result. `settle` (before a capture): then wait until the prefetches are done."""
        self.host.stage(ids, self._parts())
        if settle:
            self.host.settle()

    def cache_hit_rate(self) -> float | None:
        """Share of the host tables' distinct rows per batch found cached (None: no host table or lookup)."""
        return self.host.hit_rate() if self.host is not None else None

    def _check_range(self, ids: torch.Tensor) -> None:
        # a device-to-host read: off (check_ids=False) in timed and captured loops
        bad = ((ids < 0) | (ids >= self.sizes)).any(dim=0)  # [S]
        if bool(bad.any()):
            table = self.tables[slot_tables(self.tables)[int(bad.nonzero()[0])]]
            raise UserError(f"feature {table.feature}: ids outside its table of {table.num_embeddings} rows")

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name (views of the one buffer, or a host table's host rows; storage dtype)."""
        return {t.name: self.full_table(t.name) for t in self.tables}

    def full_table(self, name: str) -> torch.Tensor:
        """One whole table (not a copy): the per-table face checkpoints write through."""
        return self._table_part(name, 0)

    def _span(self, name: str) -> tuple[int, int]:
        """(first row in the one buffer, rows) of device table `name`."""
        index = next(i for i, t in enumerate(self.tables) if t.name == name)
        return int(self.offsets[index]), self.tables[index].num_embeddings

    def _table_part(self, name: str, part: int) -> torch.Tensor:
        """Table `name`'s rows of `_parts()[part]` (0: weights), current: a view of the buffer, or a host
        table's rows in host memory once the cached rows are written back."""
        cache = self.host.caches.get(name) if self.host is not None else None
        if cache is None:
            start, rows = self._span(name)
            return self._parts()[part][start:start + rows].detach()
        self.host.flush(self._parts())
        return cache.host[part]

    @torch.no_grad()
    def _load_table_part(self, name: str, part: int, rows: torch.Tensor) -> None:
        """Overwrite table `name`'s rows of `_parts()[part]` (a host table's cache starts empty)."""
        self._table_part(name, part).copy_(rows)
        if self.host is not None and name in self.host.caches:
            self.host.caches[name].empty(self._parts())

    @torch.no_grad()
    def load_full_weights(self, tables: dict[str, torch.Tensor]) -> None:
        """Overwrite every table from whole tables by name (a checkpoint's; any dtype or device)."""
        for t in self.tables:
            self._load_table_part(t.name, 0, tables[t.name])

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """No trainable parameters: the tables update themselves in backward (see `full_weights`)."""
        return {}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The row optimizer's state: `hyper` [lr, step] and its per-row tensors (for checkpoints)."""
        st = self.row_state
        return {"hyper": st.hyper, "state1": st.state1, "state2": st.state2}

    def table_states(self, keys: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state as whole tables: {table: {key: rows of state[src]}} for `keys` {key: src}
        (src "state1" or "state2"), copied to the CPU."""
        return {t.name: {key: self.table_state(t.name, src) for key, src in keys.items()} for t in self.tables}

    def table_state(self, name: str, src: str) -> torch.Tensor:
        """`state[src]` ("state1" or "state2") rows of one table, copied to the CPU (what a
        checkpoint writes, one table and one state at a time)."""
        return self._table_part(name, _PART[src]).to("cpu", copy=True)  # one copy, CPU or GPU

    @torch.no_grad()
    def load_table_states(self, keys: dict[str, str], tables: dict[str, dict[str, torch.Tensor]],
                          steps: float) -> None:
        """Inverse of `table_states`; `steps` is the optimizer's step count (Adam's bias correction)."""
        self.row_state.hyper[1].fill_(float(steps))
        for t in self.tables:
            for key, src in keys.items():
                self._load_table_part(t.name, _PART[src], tables[t.name][key])


_PART = {"state1": 1, "state2": 2}  # optimizer state -> its index in `_parts()`


def _capturing(ids: torch.Tensor) -> bool:
    return ids.is_cuda and torch.cuda.is_current_stream_capturing()


def _init_weights(tables: list[TableConfig], seed: int, dtype: torch.dtype, device: torch.device,
                  host: dict[str, int]) -> torch.Tensor:
    """All tables in one [R, D] buffer, each drawn like `init_table` (on `device`'s own generator: the
    same bounds, scale and zero padding row, other numbers); a host table's cache slots zero."""
    rows = sum(host.get(t.name, t.num_embeddings) for t in tables)
    weight = torch.empty(rows, tables[0].embedding_dim, dtype=dtype, device=device)
    if device.type == "meta":
        return weight
    start = 0
    for index, t in enumerate(tables):
        block = weight[start:start + host.get(t.name, t.num_embeddings)]
        start += block.shape[0]
        if t.name in host:
            block.zero_()
            continue
        if device.type == "cpu":  # the plain collection's numbers
            block.copy_(init_table(t, seed, index))
            continue
        if t.init == "zeros":
            block.zero_()
            continue
        gen = torch.Generator(device=device).manual_seed(seed * 1000003 + index)
        # fp32 in place: a second buffer of an MLPerf table would not fit beside it
        drawn = block if dtype == torch.float32 else torch.empty(block.shape, device=device)
        _draw_rows(t, drawn, gen, 0)
        if drawn is not block:
            block.copy_(drawn)
    return weight


def _draw_host(t: TableConfig, seed: int, index: int, store: torch.Tensor, device: torch.device,
               chunk: int = 1 << 20) -> None:
    """A host table's initial rows into `store`, `chunk` rows at a time: the plain collection's numbers
    for a CPU collection; on a GPU drawn there per chunk (same bounds, other numbers) and copied."""
    for a in range(0, t.num_embeddings, chunk):
        b = min(a + chunk, t.num_embeddings)
        if device.type == "cpu" or t.init == "zeros":
            store[a:b] = init_rows(t, seed, index, a, b)
            continue
        gen = torch.Generator(device=device).manual_seed((seed * 1000003 + index) * 1000003 + a // chunk)
        rows = torch.empty(b - a, t.embedding_dim, device=device)
        _draw_rows(t, rows, gen, a)
        store[a:b].copy_(rows.to(store.dtype))


def _draw_rows(t: TableConfig, out: torch.Tensor, gen: torch.Generator, first: int) -> None:
    """Table `t`'s rows first.. drawn into `out` from `gen` as `init_rows` draws them (the same bounds,
    scale and zero padding row, other numbers)."""
    bound = 1.0 / math.sqrt(t.num_embeddings)
    out.uniform_(-bound, bound, generator=gen)
    if t.init_scale != 1.0:
        out.mul_(t.init_scale)  # as `init_rows`: drawn, then scaled
    zero_padding_row(t, out, first)
