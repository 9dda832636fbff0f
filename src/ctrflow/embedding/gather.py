"""Whole tables from the shards every rank holds: what topology-independent checkpoints write.

`gather_whole` assembles one table (or one per-row state tensor) from its shards under the table's
plan; under `gathered_on_main()` only the group's first rank assembles it (the rank that writes the
checkpoint), the others sending their shards to it one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

from ctrflow.embedding.comm import group_size
from ctrflow.embedding.tables import TableConfig

_ON_MAIN: ContextVar[bool] = ContextVar("gathered_on_main", default=False)
SEND_BYTES = 256 << 20  # one message of a shard sent to the first rank


@contextmanager
def gathered_on_main() -> Iterator[None]:
    """Within: `gather_whole` assembles whole tables on the group's first rank only (a checkpoint
    that rank writes); the other ranks get zero-stride placeholders of the right shape, which hold
    no memory and must not be read. Without it every rank would hold every whole table at once."""
    token = _ON_MAIN.set(True)
    try:
        yield
    finally:
        _ON_MAIN.reset(token)


def gather_whole(table: TableConfig, tp, local: torch.Tensor | None, group, device, per_row: bool = False
                 ) -> torch.Tensor:
    """Whole `table` ([N, D], or [N] with `per_row`) from each rank's shard `local` under the table's
    plan `tp` (collective over `group`; a replica or a single process returns its own copy; on CPU)."""
    world = group_size(group)
    shape = (table.num_embeddings,) if per_row else (table.num_embeddings, table.embedding_dim)
    on_main = _ON_MAIN.get() and world > 1
    main = not on_main or dist.get_rank(group) == 0  # this rank returns the whole table
    if tp.sharding == "data" or world == 1:
        return local.detach().cpu().clone() if main else torch.zeros(()).expand(shape)
    if on_main:
        return _send_to_main(table, tp, local, group, device, per_row, shape)
    numel = [s.num_rows * (1 if per_row else s.num_cols) for s in tp.shards]
    mine = torch.zeros(max(numel), device=device)
    if local is not None:
        mine[: local.numel()] = local.detach().reshape(-1)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    full = torch.empty(shape)
    for s, n in zip(tp.shards, numel):
        _place(full, s, parts[s.rank][:n].cpu(), per_row)
    return full


def _send_to_main(table: TableConfig, tp, local: torch.Tensor | None, group, device, per_row: bool,
                  shape: tuple) -> torch.Tensor:
    """`gather_whole` under `gathered_on_main`: each shard's holder sends it to the group's first
    rank, one shard at a time and in chunks of at most `SEND_BYTES`, each through `device` (a gather
    needs one buffer per rank of the largest shard's size: a table kept whole on one rank cost world x
    its size on the first rank's device, 8 x 20 GB for MLPerf's largest table on 8 GPUs; a shard kept
    in host memory may not fit its device at all)."""
    rank = dist.get_rank(group)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    full = torch.empty(shape) if rank == 0 else None
    for s in tp.shards:
        if s.rank == 0 and rank == 0:
            _place(full, s, local.detach().cpu(), per_row)
            continue
        if rank not in (0, s.rank):
            continue
        width = 1 if per_row else s.num_cols
        step = max(1, SEND_BYTES // (4 * width))
        for a in range(0, s.num_rows, step):
            b = min(a + step, s.num_rows)
            part_shape = (b - a,) if per_row else (b - a, width)
            if rank == s.rank:  # whole tables are fp32
                part = local.detach().reshape(s.num_rows, width)[a:b].reshape(part_shape)
                dist.send(part.float().to(device).contiguous(), first, group=group)
            else:
                part = torch.empty(part_shape, device=device)
                dist.recv(part, dist.get_global_rank(group, s.rank) if group is not None else s.rank, group=group)
                _place(full, s, part.cpu(), per_row, a)
    return full if rank == 0 else torch.zeros(()).expand(shape)  # the placeholder of `gathered_on_main`


def _place(full: torch.Tensor, s, part: torch.Tensor, per_row: bool, start: int = 0) -> None:
    """Shard `s`'s values (or its rows from `start` on) into the whole table."""
    a = s.rows[0] + start
    if per_row:
        full[a:a + part.numel()] = part.reshape(-1)
    else:
        rows = part.reshape(-1, s.num_cols)
        full[a:a + rows.shape[0], s.cols[0]:s.cols[1]] = rows
