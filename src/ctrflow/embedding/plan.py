"""Sharding plans: which rank holds which rows and columns of every table.

A plan is data computed outside the model (by `plan_sharding`, from table sizes and per-rank memory,
or read from a JSON file) and applied afterwards by `ctrflow.accel.parallelize`.
Sharding types, per table:
- `table`:  the whole table on one rank;
- `row`:    contiguous row ranges, one per rank;
- `column`: embedding dims split into contiguous ranges, one per rank;
- `data`:   a full replica on every rank, gradients averaged across ranks.
Each shard also has a placement (`ctrflow.embedding.placement`): in device memory, or in host memory
with a device cache of `cache_rows` rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ctrflow.embedding.tables import TableConfig
from ctrflow.errors import UserError

SHARDING_TYPES = ("table", "row", "column", "data")
REPLICATE_BYTES = 1 << 20  # auto: tables up to 1 MiB are replicated (a dense all-reduce that small is cheap)
# the fused path replicates up to 32 MiB (MLPerf: the 8 tables of 2k-40k rows, 60 MB in all): their
# gradients' all-reduce (~62 MB) costs less than their share of the two bf16 all-to-alls (~200 MB per GPU)
FUSED_REPLICATE_BYTES = 32 << 20
# where a shard lives (`ctrflow.embedding.placement` chooses) and what a host shard costs on the device
DEVICE, HOST = "device", "host"
SLOT_MAP_BYTES = 5  # per row of a host shard, on the device: its cache slot (int32; -1: not cached), its count (fused)
SLOT_BYTES = 17  # per cache slot: the row it holds (int64), its last use (int64), dirty (bool)


@dataclass(frozen=True)
class Shard:
    """Rows [rows[0], rows[1]) and columns [cols[0], cols[1]) of one table, held by `rank`: in its
    device's memory (`placement` "device"), or in its host memory with a device cache of `cache_rows`
    rows ("host")."""

    rank: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    placement: str = "device"
    cache_rows: int = 0

    @property
    def num_rows(self) -> int:
        """Rows in this shard."""
        return self.rows[1] - self.rows[0]

    @property
    def num_cols(self) -> int:
        """Embedding dims in this shard."""
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True)
class TablePlan:
    """How one table is split: its sharding type and its shards (one per holding rank)."""

    sharding: str
    shards: tuple[Shard, ...]

    def shard_on(self, rank: int) -> Shard | None:
        """The shard `rank` holds, or None."""
        return next((s for s in self.shards if s.rank == rank), None)


@dataclass(frozen=True)
class ShardingPlan:
    """Per-table placement for `world_size` ranks, keyed by table name."""

    world_size: int
    tables: Mapping[str, TablePlan]

    def to_json(self) -> dict:
        """A JSON-able dict that `from_json` reads back exactly."""
        return {
            "world_size": self.world_size,
            "tables": {
                name: {
                    "sharding": tp.sharding,
                    "shards": [{"rank": s.rank, "rows": list(s.rows), "cols": list(s.cols), "placement": s.placement,
                                **({"cache_rows": s.cache_rows} if s.placement == "host" else {})}
                               for s in tp.shards],
                }
                for name, tp in self.tables.items()
            },
        }

    @staticmethod
    def from_json(data: Mapping) -> "ShardingPlan":
        """Inverse of `to_json`."""
        tables = {
            name: TablePlan(
                spec["sharding"],
                tuple(Shard(int(s["rank"]), tuple(s["rows"]), tuple(s["cols"]), s.get("placement", "device"),
                            int(s.get("cache_rows", 0))) for s in spec["shards"]),
            )
            for name, spec in data["tables"].items()
        }
        return ShardingPlan(int(data["world_size"]), tables)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (readable by `--plan FILE`)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def bytes_per_rank(self, tables: list[TableConfig],
                       memory_of: Callable[[TableConfig], int] | None = None) -> list[int]:
        """Device memory each rank holds for these tables (weights, or `memory_of` incl. optimizer
        state; a shard in host memory: its cache and slot map, `device_bytes`)."""
        memory_of = memory_of or (lambda t: t.bytes)
        totals = [0] * self.world_size
        for t in tables:
            for s in self.tables[t.name].shards:
                totals[s.rank] += device_bytes(t, s, memory_of)
        return totals

    def describe(self, tables: list[TableConfig], memory_of: Callable[[TableConfig], int] | None = None) -> str:
        """A human-readable table of the plan and the device memory per rank (printed on rank 0)."""
        lines = [f"{'table':<16} {'rows':>11} {'dim':>5} {'sharding':<8} {'ranks':<8} placement"]
        for t in tables:
            tp = self.tables[t.name]
            ranks = ",".join(str(s.rank) for s in tp.shards)
            where = ", ".join(dict.fromkeys(f"host, cache {s.cache_rows:,} rows" if s.placement == "host"
                                            else "device" for s in tp.shards))
            lines.append(f"{t.name:<16} {t.num_embeddings:>11} {t.embedding_dim:>5} {tp.sharding:<8} {ranks:<8} "
                         f"{where}")
        per_rank = self.bytes_per_rank(tables, memory_of)
        lines.append("device memory per rank (MiB): "
                     + ", ".join(f"{r}: {b / 2**20:.1f}" for r, b in enumerate(per_rank)))
        return "\n".join(lines)

    def on_host(self) -> list[tuple[str, Shard]]:
        """(table, shard) of every shard kept in host memory."""
        return [(name, s) for name, tp in self.tables.items() for s in tp.shards if s.placement == "host"]


def shards_for(table: TableConfig, sharding: str, world_size: int, rank: int = 0) -> tuple[Shard, ...]:
    """The shards of one table under one sharding type (`rank` places a table-wise table)."""
    n, d = table.num_embeddings, table.embedding_dim
    if sharding == "table":
        return (Shard(rank, (0, n), (0, d)),)
    if sharding == "data":
        return tuple(Shard(r, (0, n), (0, d)) for r in range(world_size))
    if sharding == "row":
        block = -(-n // world_size)  # ceil: the last ranks may hold fewer (or no) rows
        bounds = [(r * block, min(n, (r + 1) * block)) for r in range(world_size)]
        return tuple(Shard(r, b, (0, d)) for r, b in enumerate(bounds) if b[1] > b[0])
    if sharding == "column":
        if d < world_size:
            raise UserError(f"table {table.name}: column sharding needs embedding_dim ({d}) "
                            f">= world size ({world_size})")
        edges = [d * r // world_size for r in range(world_size + 1)]
        return tuple(Shard(r, (0, n), (edges[r], edges[r + 1])) for r in range(world_size))
    raise UserError(f"table {table.name}: unknown sharding {sharding!r}; choose one of {', '.join(SHARDING_TYPES)}")


def plan_sharding(
    tables: list[TableConfig],
    world_size: int,
    sharding: str = "auto",
    memory_budget: int | list[int] | None = None,
    memory_of: Callable[[TableConfig], int] | None = None,
    overrides: Mapping[str, str | Mapping] | None = None,
    replicate_bytes: int = REPLICATE_BYTES,
    large: str = "row",
) -> ShardingPlan:
    """Place every table on `world_size` ranks, balancing memory and lookup load.

    `sharding` other than "auto" applies one type to every table (table-wise ones spread greedily).
    "auto": tiny tables are replicated; a table above a quarter of a rank's fair share of memory is
    row-wise (its lookups spread evenly too); the rest go whole to the rank with the least memory
    plus lookup load that still has room. `memory_budget` is bytes per rank (None: unlimited);
    `memory_of(table)` the bytes a table costs incl. optimizer state (default: its weights);
    `overrides` maps table names to a sharding type or a saved plan entry. `large` is what "auto"
    does with the large tables: "row" (split over every rank) or "table" (whole, spread to even out
    the lookups per rank, row-wise only where no rank has room: static exchange sizes, the fused
    path's choice; replicated tables then move whole where that evens out the ranks' lookups).
    """
    memory_of = memory_of or (lambda t: t.bytes)
    budgets = _budgets(memory_budget, world_size)
    names = {t.name for t in tables}
    unknown = sorted(set(overrides or {}) - names)
    if unknown:
        raise UserError(f"sharding plan names unknown tables: {', '.join(unknown)}")
    fair_share = sum(memory_of(t) for t in tables) / world_size
    used, load = [0.0] * world_size, [0.0] * world_size
    placed: dict[str, TablePlan] = {}
    # largest first: greedy packing works best; with whole large tables, most lookups first (the longest-
    # job-first rule: the busiest rank, which the exchanges and the update wait for, is left least busy)
    order = (lambda t: (-_lookup_load(t), -memory_of(t))) if large == "table" else (lambda t: -memory_of(t))
    for t in sorted(tables, key=order):
        spec = (overrides or {}).get(t.name, sharding)
        if isinstance(spec, Mapping):
            placed[t.name] = _table_plan_from_spec(t, spec, world_size)
        else:
            kind = (_choose_auto(t, world_size, memory_of, fair_share, replicate_bytes, large) if spec == "auto"
                    else spec)
            if kind == "column" and t.embedding_dim < world_size and t.name not in (overrides or {}):
                kind = "table"  # e.g. DeepFM's dim-1 tables: too narrow to split
            rank = (_least_loaded(t, world_size, memory_of, used, load, budgets, by_load=large == "table")
                    if kind == "table" else 0)
            if rank is None:  # no rank has room for the whole table
                kind, rank = ("row", 0) if spec == "auto" else (kind, 0)
            placed[t.name] = TablePlan(kind, shards_for(t, kind, world_size, rank))
        for s in placed[t.name].shards:
            frac = s.num_rows * s.num_cols / (t.num_embeddings * t.embedding_dim)
            used[s.rank] += memory_of(t) * frac
            load[s.rank] += _lookup_load(t) * (s.num_rows / t.num_embeddings if s.num_cols == t.embedding_dim else 1.0)
    if sharding == "auto" and large == "table" and world_size > 1:
        _spread_replicas(tables, placed, set(overrides or {}), world_size, memory_of, used)
    _check_budgets(used, budgets)
    return ShardingPlan(world_size, {t.name: placed[t.name] for t in tables})


def _spread_replicas(tables: list[TableConfig], placed: dict[str, TablePlan], fixed: set[str], world_size: int,
                     memory_of, used: list[float]) -> None:
    """Even out the ranks' lookups per step with the small tables: a replicated table costs every rank
    its own samples' ids, a whole one its rank every rank's. While it lowers the busiest rank's work,
    a replicated table (most ids a sample first, then most rows: tiny tables' few rows are each hit by
    much of the batch) moves whole onto the rank with the least, which takes (N - 1) x its ids while
    every other rank sheds them. MLPerf DLRMv2 on 2 ranks: C21's 100 ids a sample whole on one rank, 70
    on the other, each 44 of replicas; 30 of them move to the lighter rank (benchmarks/NOTES.md)."""
    by_name = {t.name: t for t in tables}
    work = [0.0] * world_size
    for name, tp in placed.items():
        t = by_name[name]
        for s in tp.shards:
            share = 1.0 if tp.sharding == "data" else world_size * s.num_rows * s.num_cols / (
                t.num_embeddings * t.embedding_dim)
            work[s.rank] += _lookup_load(t) * share
    movable = [t for t in tables if placed[t.name].sharding == "data" and t.name not in fixed]
    for t in sorted(movable, key=lambda t: (-_lookup_load(t), -t.num_embeddings, t.name)):
        load, rank = _lookup_load(t), min(range(world_size), key=lambda r: (work[r], r))
        moved = [w - load + (world_size * load if r == rank else 0.0) for r, w in enumerate(work)]
        if max(moved) >= max(work):
            continue
        work = moved
        placed[t.name] = TablePlan("table", shards_for(t, "table", world_size, rank))
        for r in range(world_size):
            if r != rank:
                used[r] -= memory_of(t)


def _choose_auto(t: TableConfig, world_size: int, memory_of, fair_share: float, replicate_bytes: int,
                 large: str = "row") -> str:
    if world_size == 1:
        return "table"
    if t.bytes <= replicate_bytes:
        return "data"
    return large if memory_of(t) > fair_share / 4 else "table"


def _least_loaded(t: TableConfig, world_size: int, memory_of, used, load, budgets, by_load: bool = False
                  ) -> int | None:
    """The rank where this table adds least to the larger of its memory and lookup shares, or
    (`by_load`) the least lookup load, then memory: the all-to-all and the fused update wait for
    the busiest rank (None when no rank has room for it)."""
    need = memory_of(t)
    fits = [r for r in range(world_size) if used[r] + need <= budgets[r]]
    if not fits:
        return None
    if by_load:
        return min(fits, key=lambda r: (load[r], used[r], r))
    total_mem = max(sum(used) + need, 1.0)
    total_load = max(sum(load) + _lookup_load(t), 1.0)
    return min(fits, key=lambda r: (max((used[r] + need) / total_mem, (load[r] + _lookup_load(t)) / total_load), r))


def _lookup_load(t: TableConfig) -> int:
    """A table's lookup work per sample: its dim times its ids (a multi-hot bag reads `length` rows,
    though it sends back one pooled vector)."""
    return t.embedding_dim * t.length


def _budgets(memory_budget: int | list[int] | None, world_size: int) -> list[float]:
    if memory_budget is None:
        return [float("inf")] * world_size
    if isinstance(memory_budget, (int, float)):
        return [float(memory_budget)] * world_size
    if len(memory_budget) != world_size:
        raise ValueError(f"memory_budget has {len(memory_budget)} entries for {world_size} ranks")
    return [float(b) for b in memory_budget]


def _check_budgets(used: list[float], budgets: list[float]) -> None:
    over = [r for r in range(len(used)) if used[r] > budgets[r]]
    if over:
        r = over[0]
        raise UserError(
            f"sharding plan does not fit: rank {r} needs {used[r] / 2**30:.2f} GiB of embeddings, "
            f"budget {budgets[r] / 2**30:.2f} GiB (use more ranks, row sharding, or a smaller model)"
        )


def _table_plan_from_spec(t: TableConfig, spec: Mapping, world_size: int) -> TablePlan:
    """A plan entry given as {"sharding": ..., "ranks": [r]} or a full saved entry with shards."""
    kind = spec.get("sharding", "auto")
    if "shards" in spec:
        tp = ShardingPlan.from_json({"world_size": world_size, "tables": {t.name: spec}}).tables[t.name]
        _validate_table_plan(t, tp, world_size)
        return tp
    rank = int(spec.get("rank", 0))
    if not 0 <= rank < world_size:
        raise UserError(f"table {t.name}: plan puts it on rank {rank}, but world size is {world_size}")
    return TablePlan(kind, shards_for(t, kind, world_size, rank))


def _validate_table_plan(t: TableConfig, tp: TablePlan, world_size: int) -> None:
    """Shards must cover the table exactly once (replicas aside) and sit on existing ranks."""
    if tp.sharding not in SHARDING_TYPES:
        raise UserError(f"table {t.name}: unknown sharding {tp.sharding!r}")
    for s in tp.shards:
        if not 0 <= s.rank < world_size:
            raise UserError(f"table {t.name}: plan puts a shard on rank {s.rank}, but world size is {world_size}")
    replicas = world_size if tp.sharding == "data" else 1
    covered = sum(s.num_rows * s.num_cols for s in tp.shards)
    if covered != replicas * t.num_embeddings * t.embedding_dim:
        raise UserError(f"table {t.name}: plan shards cover {covered} cells of {t.num_embeddings}x{t.embedding_dim}")
    if tp.sharding != "data" and len({s.rank for s in tp.shards}) != len(tp.shards):
        raise UserError(f"table {t.name}: plan puts two shards on one rank")


def read_plan_overrides(path: str | Path) -> dict[str, str | dict]:
    """Per-table choices from a plan file: a saved `ShardingPlan`, or {"tables": {name: "row" | {...}}}.

    Entries are checked against the tables and world size by `plan_sharding`.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: cannot read sharding plan: {err}") from err
    tables = data.get("tables") if isinstance(data, dict) else None
    if not isinstance(tables, dict):
        raise UserError(f'{path}: a sharding plan needs a "tables" object mapping table names to shardings')
    for name, spec in tables.items():
        kind = spec if isinstance(spec, str) else spec.get("sharding") if isinstance(spec, dict) else None
        if kind not in SHARDING_TYPES:
            raise UserError(f"{path}: table {name}: sharding must be one of {', '.join(SHARDING_TYPES)}, got {kind!r}")
    return tables


def device_memory_budget(device, fraction: float = 0.85) -> int | None:
    """Bytes of free memory on a CUDA device times `fraction` (None on CPU: no limit unless given)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * fraction)


def row_bytes(t: TableConfig, s: Shard, memory_of: Callable[[TableConfig], int]) -> float:
    """Device bytes of one row of shard `s` with its optimizer state."""
    return memory_of(t) / t.num_embeddings * s.num_cols / t.embedding_dim


def device_bytes(t: TableConfig, s: Shard, memory_of: Callable[[TableConfig], int]) -> int:
    """Device bytes shard `s` takes: all its rows with their state, or (host) its cache and slot map."""
    if s.placement == HOST:
        return int(s.cache_rows * (row_bytes(t, s, memory_of) + SLOT_BYTES) + s.num_rows * SLOT_MAP_BYTES)
    return memory_of(t) * s.num_rows * s.num_cols // (t.num_embeddings * t.embedding_dim)
