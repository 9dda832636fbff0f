"""What an embedding collection does with the tables (or shards) its plan keeps in host memory.

The plain and the sharded collection both hold, per table of this process, either a parameter of all
its rows on the device or a `HostCache` whose device cache is the parameter (`weights[name]` either
way: optimizers and the dense/sparse split see one parameter per table). These methods are the few
places where the two differ: the lookup (ids -> cache slots), the whole local rows (checkpoints) and
loading them.
"""

from __future__ import annotations

import torch
from torch import nn

from ctrflow.embedding.cache import HostCache


class HostTables:
    """Mixin of the embedding collections: `caches` maps a table name to the `HostCache` of this
    process's part of it (absent: the part is on the device, `weights[name]`)."""

    caches: dict[str, HostCache]
    weights: nn.ParameterDict

    def keep_on_host(self, name: str, cache: HostCache) -> None:
        """Serve table `name` (this process's part) from `cache`: its cache is the table's parameter."""
        self.caches[name] = cache
        self.weights[name] = cache.weight

    def lookup(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (this process's part of table `name`, local ids) with sparse gradients."""
        cache = self.caches.get(name)
        return nn.functional.embedding(ids if cache is None else cache.slots(ids), self.weights[name], sparse=True)

    def local_rows(self, name: str) -> torch.Tensor:
        """All rows of this process's part of table `name`, current (not a copy)."""
        cache = self.caches.get(name)
        return self.weights[name].detach() if cache is None else cache.whole()

    @torch.no_grad()
    def load_local_rows(self, name: str, rows: torch.Tensor) -> None:
        """Take all rows of this process's part of table `name`."""
        cache = self.caches.get(name)
        if cache is None:
            self.weights[name].copy_(rows)
        else:
            cache.load(rows)

    def cache_hit_rate(self) -> float | None:
        """Share of the distinct rows looked up that were already cached, over the host tables (None: none)."""
        looked_up = sum(c.rows_looked_up for c in self.caches.values())
        return sum(c.rows_hit for c in self.caches.values()) / looked_up if looked_up else None
