"""Where each shard of a table lives: in device memory, or in host memory with a device cache of its
hottest rows (`ctrflow.embedding.cache.HostCache`), chosen from a memory budget per process.

As with FBGEMM's table placements, this is a property of a shard in the `ShardingPlan`, not a kind of
table the model knows of. `place_in_budget` takes a plan (which rank holds which rows) and a budget of
device bytes per rank for the tables, weights and optimizer state, and on every rank:
1. keeps on the device the shards that must stay there: replicas (`data`: small, and every rank
   updates its own copy), tables whose optimizer steps every row each step (dense Adam), and shards
   no larger than their smallest cache would be;
2. fills the rest of the budget with whole shards, fewest bytes per lookup first (a shard's device
   bytes over the ids a sample looks up in it: a table's `length`, a row shard's share of it): the
   shards that serve the most lookups for their memory;
3. gives each shard left a host store and a device cache from what the budget has left, in proportion
   to the ids a sample looks up in it (each cache at least two batches' ids: a batch's rows must all be
   in the cache, and the previous batch's step may still be reading its own). Under the power laws of
   click logs (the k-th most used row looked up ~1/k as often), a cache of C of a table's N rows catches
   ~ln C / ln N of its lookups, and the misses of all tables are fewest when each table's cache grows
   with its lookups.
A plan that does not fit even so (the slot maps and the smallest caches over the budget) is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ctrflow.embedding.plan import (DEVICE, HOST, SLOT_BYTES, SLOT_MAP_BYTES, Shard, ShardingPlan, TablePlan,
                                    device_bytes, row_bytes)
from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError



@dataclass(frozen=True)
class HostTier:
    """What `place_in_budget` needs besides the plan: the device bytes per rank the tables may take,
    the most ids of one table's column a lookup serves (`batch_ids`, the larger of the global train
    batch and the evaluation batch) and the tables that must stay whole on the device."""

    budget: int
    batch_ids: int
    device_only: Callable[[TableConfig], bool] = lambda t: False


def place_in_budget(plan: ShardingPlan, tables: list[TableConfig], tier: HostTier,
                    memory_of: Callable[[TableConfig], int]) -> ShardingPlan:
    """`plan` with each shard placed on the device or on the host with a cache (the module doc's
    rule), every rank's device bytes within `tier.budget`."""
    if tier.budget <= 0:
        raise UserError(f"--embedding-memory-gib must be positive (GiB a process), got {tier.budget / 2**30:g}")
    by_name = {t.name: t for t in tables}
    placed: dict[tuple[str, int], Shard] = {}
    for rank in range(plan.world_size):
        mine = [(by_name[name], s) for name, tp in plan.tables.items() for s in tp.shards if s.rank == rank]
        pinned = [(t, s) for t, s in mine if plan.tables[t.name].sharding == "data" or tier.device_only(t)
                  or _least_rows(t, s, tier.batch_ids) == s.num_rows]
        used = sum(device_bytes(t, s, memory_of) for t, s in pinned)
        rest = sorted((x for x in mine if x not in pinned), key=lambda x: _bytes_per_lookup(*x, memory_of))
        # a shard goes whole only where the smallest caches of all the others still fit beside it
        reserve = sum(_least_bytes(t, s, memory_of, tier.batch_ids) for t, s in rest)
        host = []
        for t, s in rest:
            least = _least_bytes(t, s, memory_of, tier.batch_ids)
            if used + device_bytes(t, s, memory_of) + reserve - least <= tier.budget:
                used += device_bytes(t, s, memory_of)
                reserve -= least
            else:
                host.append((t, s))
        if used > tier.budget:
            raise UserError(f"embedding memory budget too small: rank {rank} needs {used / 2**20:,.1f} MiB for the "
                            f"tables that stay on the device (replicated, dense Adam, or no larger than two batches' "
                            f"ids), budget {tier.budget / 2**20:,.1f} MiB; raise --embedding-memory-gib")
        caches = _cache_rows(host, tier.budget - used, memory_of, tier.batch_ids, rank)
        for (t, s), rows in zip(host, caches):
            placed[(t.name, s.rank)] = replace(s, placement=HOST, cache_rows=rows)
    return ShardingPlan(plan.world_size, {
        name: TablePlan(tp.sharding, tuple(placed.get((name, s.rank), s) for s in tp.shards))
        for name, tp in plan.tables.items()})


def _least_rows(t: TableConfig, s: Shard, batch_ids: int) -> int:
    """The smallest cache of a shard: two batches' ids of its table and a slot for a bag's padding
    row (the fused path keeps it cached), at most its rows."""
    return min(s.num_rows, 2 * batch_ids * t.length + 1)


def _least_bytes(t: TableConfig, s: Shard, memory_of, batch_ids: int) -> int:
    """Device bytes of a shard in host memory with its smallest cache."""
    return device_bytes(t, replace(s, placement=HOST, cache_rows=_least_rows(t, s, batch_ids)), memory_of)


def _bytes_per_lookup(t: TableConfig, s: Shard, memory_of) -> float:
    lookups = t.length * (s.num_rows / t.num_embeddings)  # a row shard serves its share of the ids
    return device_bytes(t, s, memory_of) / max(lookups, 1e-12)


def _cache_rows(host: list[tuple[TableConfig, Shard]], left: float, memory_of, batch_ids: int,
                rank: int) -> list[int]:
    """Cache rows of each host shard, from the `left` bytes after the slot maps: in proportion to the
    ids a sample looks up in it (module doc), each between its least (two batches' ids) and its rows."""
    if not host:
        return []
    per_row = [row_bytes(t, s, memory_of) + SLOT_BYTES for t, s in host]
    least = [_least_rows(t, s, batch_ids) for t, s in host]
    left -= sum(s.num_rows * SLOT_MAP_BYTES for _, s in host)
    need = sum(n * b for n, b in zip(least, per_row))
    if need > left:
        names = ", ".join(t.name for t, _ in host)
        raise UserError(
            f"embedding memory budget too small: rank {rank} keeps {names} in host memory, whose slot maps "
            f"and smallest caches (two batches' ids each) need {(need - left) / 2**20:,.1f} MiB "
            f"more than the budget leaves; raise --embedding-memory-gib or lower the batch size")
    lookups = [t.length * s.num_rows / t.num_embeddings for t, s in host]
    rows: list[int] = [0] * len(host)
    free = set(range(len(host)))
    while free:  # water filling: rows in proportion to lookups, caches held at a bound taken out
        spare = left - sum(rows[i] * per_row[i] for i in range(len(host)) if i not in free)
        share = spare / sum(lookups[i] * per_row[i] for i in free)  # cache rows per id a sample
        wanted = {i: share * lookups[i] for i in free}
        low = {i for i in free if wanted[i] < least[i]}
        high = {i for i in free if wanted[i] >= host[i][1].num_rows}
        for i in low or high:  # the low bounds first: raising them leaves less for the rest
            rows[i] = least[i] if low else host[i][1].num_rows
        free -= low or high
        if not (low or high):
            for i in free:
                rows[i] = int(wanted[i])
            break
    return rows


def placement_summary(plan: ShardingPlan | None) -> str:
    """"device" (every shard), or the shards on each side and the host shards' cache rows in all
    ("device 14, host 12 (caches of 7,558 rows)"): short enough for a tracker param."""
    host = plan.on_host() if plan is not None else []
    if not host:
        return DEVICE
    shards = sum(len(tp.shards) for tp in plan.tables.values())
    return f"device {shards - len(host)}, host {len(host)} (caches of {sum(s.cache_rows for _, s in host):,} rows)"
