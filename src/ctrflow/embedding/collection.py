"""The plain (single-process) embedding collection: the reference every faster path matches."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from ctrflow.embedding.cache import HostCache
from ctrflow.embedding.host import HostTables
from ctrflow.embedding.pooling import is_one_hot, pool_bags
from ctrflow.embedding.tables import TableConfig

INIT_BLOCK_ROWS = 1 << 16  # rows drawn from one generator: any row range is drawable on its own
_DEFERRED: ContextVar[bool] = ContextVar("deferred_tables", default=False)


def init_rows(table: TableConfig, seed: int, index: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a table's deterministic initial weights, whatever the later sharding.

    DLRM's uniform(-1/sqrt(n), 1/sqrt(n)), drawn in blocks of `INIT_BLOCK_ROWS` rows, each from a
    generator seeded by (seed, table, block): every process, and every shard of the table, gets the
    same numbers while drawing only the blocks it holds (an MLPerf table is 20 GB in fp32); then
    multiplied by the table's `init_scale`. A table whose `init` is "zeros" (first-order weights)
    starts at zero, and so does a multi-hot table's padding row (`zero_padding_row`).
    """
    if table.init == "zeros":
        return torch.zeros(stop - start, table.embedding_dim)
    bound = 1.0 / math.sqrt(table.num_embeddings)
    out = torch.empty(stop - start, table.embedding_dim)
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        lo = block * INIT_BLOCK_ROWS
        hi = min(lo + INIT_BLOCK_ROWS, table.num_embeddings)
        gen = torch.Generator().manual_seed((seed * 1000003 + index) * 1000003 + block)
        rows = torch.empty(hi - lo, table.embedding_dim).uniform_(-bound, bound, generator=gen)
        a, b = max(lo, start), min(hi, stop)
        out[a - start:b - start] = rows[a - lo:b - lo]
    if table.init_scale != 1.0:
        out.mul_(table.init_scale)
    zero_padding_row(table, out, start)
    return out


def zero_padding_row(table: TableConfig, rows: torch.Tensor, start: int = 0) -> None:
    """Zero row 0 of a multi-hot table where `rows` (the table's rows from `start`) holds it.

    Padding (id 0 of a bag) never reaches an output, so its row is never read; at zero it stays
    zero under every optimizer and the embedding L2 (its gradient is zero), whichever path
    touches it: the row-wise shards never see padding, the other paths look it up."""
    if table.pooling is not None and start == 0 and rows.shape[0]:
        rows[0].zero_()


def init_table(table: TableConfig, seed: int, index: int) -> torch.Tensor:
    """A whole table's initial weights (`init_rows` over all its rows)."""
    return init_rows(table, seed, index, 0, table.num_embeddings)


@contextmanager
def deferred_tables() -> Iterator[None]:
    """Collections built inside hold no table memory (meta parameters): their rows are drawn when
    a sharded or fused collection takes them (`table_rows`), or on `materialize()`."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def table_rows(collection: nn.Module, index: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of table `index` of a plain or fused collection as they are now (the
    initial ones for a deferred collection), without materializing the whole table."""
    if getattr(collection, "deferred", False):
        return init_rows(collection.tables[index], collection.seed, index, start, stop)
    return collection.full_weights()[collection.tables[index].name][start:stop]


def copy_table_rows(collection: nn.Module, index: int, start: int, stop: int, out: torch.Tensor,
                    chunk: int = 1 << 20) -> None:
    """`out[:] = table_rows(...)` in chunks of rows, so the host holds one chunk at a time."""
    for a in range(start, stop, chunk):
        b = min(a + chunk, stop)
        out[a - start:b - start].copy_(table_rows(collection, index, a, b))


class EmbeddingCollection(HostTables, nn.Module):
    """Ids [B, S] (each table's `length` slots in order: one per categorical feature) -> [B, T, D],
    one vector per table: a one-id table's row as is, a multi-hot table's rows pooled by
    `ctrflow.embedding.pooling.pool_bags` (sum or mean, padding id 0 contributing nothing).

    Weights are one parameter per table (`weights[table.name]`); lookups produce sparse
    gradients so that optimizers touch only the rows a batch used. A collection of no tables (a
    dataset without sparse features) returns [B, 0, D] of `embedding_dim`. A table the plan keeps in
    host memory (`place_on_host`) is served by a `HostCache`, whose device cache is its parameter.
    """

    def __init__(self, tables: list[TableConfig], seed: int = 0, embedding_dim: int | None = None):
        super().__init__()
        dims = {t.embedding_dim for t in tables} | ({embedding_dim} if embedding_dim is not None else set())
        if len(dims) != 1:
            raise ValueError(f"all tables of one collection need one embedding_dim, got {sorted(dims)}")
        self.tables = list(tables)
        self.embedding_dim = dims.pop()
        self.one_hot = is_one_hot(self.tables)
        self.seed, self.deferred = seed, _DEFERRED.get()
        self.caches: dict[str, HostCache] = {}
        self.weights = nn.ParameterDict(
            {t.name: nn.Parameter(torch.empty(t.num_embeddings, t.embedding_dim, device="meta") if self.deferred
                                  else init_table(t, seed, i)) for i, t in enumerate(self.tables)}
        )

    def materialize(self, device: torch.device | str = "cpu") -> None:
        """Draw the tables of a deferred collection onto `device`, one at a time (no-op otherwise)."""
        if self.deferred:
            for i, t in enumerate(self.tables):
                if t.name not in self.caches:
                    self.weights[t.name] = nn.Parameter(init_table(t, self.seed, i).to(device))
            self.deferred = False

    def place_on_host(self, name: str, cache_rows: int, device: torch.device | str) -> None:
        """Keep table `name` in host memory with a device cache of `cache_rows` rows, its current rows
        (a deferred table's are drawn straight into host memory)."""
        i = next(i for i, t in enumerate(self.tables) if t.name == name)
        t = self.tables[i]
        self.keep_on_host(name, HostCache(t.num_embeddings, t.embedding_dim, cache_rows, device,
                                          lambda store: copy_table_rows(self, i, 0, t.num_embeddings, store)))

    def prefetch(self, ids: torch.Tensor, train: bool = True) -> None:
        """Bring the rows of batch `ids` [B, S] into the caches of the host tables ahead of its forward
        (which takes the prefetched batches in order; `HostCache`)."""
        start = 0
        for t in self.tables:
            if t.name in self.caches:
                self.caches[t.name].prefetch(ids[:, start] if self.one_hot else ids[:, start:start + t.length], train)
            start += t.length

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tables:
            return torch.zeros(ids.shape[0], 0, self.embedding_dim, device=ids.device)
        if self.one_hot:
            columns = [self.lookup(t.name, ids[:, i]) for i, t in enumerate(self.tables)]
            return torch.stack(columns, dim=1)  # [B, F, D]
        slots, start = [], 0
        for t in self.tables:  # every slot's row, [B, length, D] per table
            slots.append(self.lookup(t.name, ids[:, start:start + t.length]))
            start += t.length
        return pool_bags(torch.cat(slots, dim=1), ids, self.tables)  # [B, S, D] -> [B, T, D]

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Whole tables by name, for topology-independent checkpoints and export (draws a deferred
        collection's tables first)."""
        return {t.name: self.full_table(t.name) for t in self.tables}

    def full_table(self, name: str) -> torch.Tensor:
        """One whole table (a view; a host table's store): checkpoints are written one table at a
        time, so the sharded collections, which must gather, never hold two whole tables; this is
        the same face."""
        self.materialize()
        return self.local_rows(name)

    def load_full_weights(self, tables: Mapping[str, torch.Tensor]) -> None:
        """Take whole tables by name (e.g. from a checkpoint)."""
        for t in self.tables:
            self.load_local_rows(t.name, tables[t.name])


def materialize_tables(model: nn.Module) -> None:
    """Draw every deferred `EmbeddingCollection` left in `model` (those no faster path took)."""
    for module in model.modules():
        if isinstance(module, EmbeddingCollection):
            module.materialize()
