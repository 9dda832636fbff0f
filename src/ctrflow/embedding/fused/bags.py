"""Host side of fused multi-hot lookups: ids [B, S] of id slots -> pooled [B, T, D], and the update.

Every slot reads its own table of the one buffer (`BagLayout.slot_offsets`: the row of its table's
id 0). On CUDA with Triton, `lookup_bags` is one kernel (`bag_kernels.bag_forward_kernel`: gather
and pool, no [B, S, D] in memory) and `update_bags` feeds the bag gradients to the one-hot path's
sort / accumulate / update kernels, each slot reading its bag's gradient times its weight in the bag
(`pooling.slot_scales`: padding gets nothing, a mean bag's ids 1/count each). Elsewhere the same
arithmetic runs in torch: `pooling.pool_bags` forward, `ops.update_rows` on per-slot gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ctrflow.embedding.fused import ops
from ctrflow.embedding.pooling import pool_bags, slot_scales, slot_tables
from ctrflow.embedding.tables import TableConfig

if ops.kernels is not None:
    from ctrflow.embedding.fused import bag_kernels


@dataclass(frozen=True)
class BagLayout:
    """Where a collection's slots and tables lie (device tensors beside the buffer)."""

    tables: tuple[TableConfig, ...]
    slot_offsets: torch.Tensor  # [S] int64: buffer row of the id 0 of each slot's table
    slot_table: torch.Tensor  # [S] int32: each slot's table (its column of the pooled output)
    table_start: torch.Tensor  # [T] int32: each table's first slot
    table_length: torch.Tensor  # [T] int32: its slots
    table_mode: torch.Tensor  # [T] int32: one id (0), sum (1) or mean (2) bag
    table_offset: torch.Tensor  # [T] int64: buffer row of its id 0


def layout_tensors(tables: Sequence[TableConfig], offsets: Sequence[int]) -> dict[str, torch.Tensor]:
    """`BagLayout`'s tensors (on the CPU) for tables starting at buffer rows `offsets`."""
    owner = slot_tables(tables)
    starts = [0]
    for t in tables[:-1]:
        starts.append(starts[-1] + t.length)
    modes = [0 if t.pooling is None else (1 if t.pooling == "sum" else 2) for t in tables]
    return {"slot_offsets": torch.tensor([offsets[i] for i in owner], dtype=torch.int64),
            "slot_table": torch.tensor(owner, dtype=torch.int32),
            "table_start": torch.tensor(starts, dtype=torch.int32),
            "table_length": torch.tensor([t.length for t in tables], dtype=torch.int32),
            "table_mode": torch.tensor(modes, dtype=torch.int32),
            "table_offset": torch.tensor(list(offsets), dtype=torch.int64)}


def lookup_bags(ids: torch.Tensor, layout: BagLayout, weight: torch.Tensor, out_dtype: torch.dtype,
                save_scales: bool = False, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pooled [B, T, D] in `out_dtype`, written into `out` (contiguous) when given; each slot's weight
    in its bag [B, S] fp32 if `save_scales`)."""
    batch, slots = ids.shape
    tables, dim = len(layout.tables), weight.shape[1]
    if not ops.uses_kernels(weight):
        values = weight[(ids + layout.slot_offsets).reshape(-1)].view(batch, slots, dim).float()
        pooled = pool_bags(values, ids, layout.tables).to(out_dtype)
        out = pooled if out is None else out.copy_(pooled)
        return out, (slot_scales(ids, layout.tables) if save_scales else None)
    ids = ids.contiguous()
    if out is None:
        out = torch.empty(batch, tables, dim, dtype=out_dtype, device=weight.device)
    scales = torch.empty(batch, slots, dtype=torch.float32, device=weight.device) if save_scales else None
    if batch == 0 or tables == 0:
        return out, scales
    block_d = ops.triton.next_power_of_2(dim)
    block_b = max(32, min(128, 4096 // block_d))  # a [BLOCK_B, BLOCK_D] fp32 sum of ~32 registers a thread
    bag_kernels.bag_forward_kernel[(ops.triton.cdiv(batch, block_b), tables)](
        ids, layout.table_start, layout.table_length, layout.table_mode, layout.table_offset, weight, out,
        out if scales is None else scales, batch, slots, tables, D=dim, BLOCK_D=block_d, BLOCK_B=block_b,
        SAVE_SCALES=scales is not None, num_warps=4)
    return out, scales


def update_bags(ids: torch.Tensor, layout: BagLayout, grad: torch.Tensor, scales: torch.Tensor,
                weight: torch.Tensor, state: ops.RowState, scratch: dict, pre_reduce: bool = True,
                grad_scale: float = 1.0, presorted: tuple | None = None) -> None:
    """One optimizer step on the rows ids [B, S] touched, given the pooled output's grad [B, T, D] and
    `scales` [B, S] from `lookup_bags` (as `ops.update_rows` does for one-id lookups; `presorted`:
    `ops.sort_rows` of ids + slot offsets, done earlier)."""
    ops.update_rows(ids, layout.slot_offsets, grad, weight, state, scratch, pre_reduce, grad_scale,
                    presorted=presorted, bags=(layout.slot_table, scales))
