"""Triton kernel of the fused multi-hot lookup: gather and pool in one pass, no [B, S, D] in memory.

The tables live in one buffer `weight` [R, D] (`FusedEmbeddingCollection`); ids are [B, S], each
table taking `length` consecutive slots. A program pools table t (grid axis 1) for BLOCK_B samples
(grid axis 0): it walks t's slots, gathers the rows of ids that count (every id of a one-id table;
the non-padding ids of a bag), sums them in fp32 registers and writes out[b, t] once, divided by the
count for a mean bag (`ctrflow.embedding.pooling.pool_bags`'s rule). One program's samples share
one table, so its loop runs that table's length, however long other tables' bags are.

With SAVE_SCALES it also writes each slot's weight in its bag ([B, S] fp32: 1 for a one-id table,
0 for padding, 1 or 1/count in a bag; `pooling.slot_scales`): the backward's per-slot gradient is
the bag's gradient times that weight (`kernels.accumulate_segments_kernel` with BAGS).
"""

from __future__ import annotations

import triton
import triton.language as tl

# table modes (`bags.BagLayout.table_mode`); constexpr: a kernel may read only constexpr globals
ONE_ID, SUM, MEAN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def bag_forward_kernel(ids_ptr, table_start_ptr, table_length_ptr, table_mode_ptr, table_offset_ptr, weight_ptr,
                       out_ptr, scale_ptr, batch, num_slots, num_tables,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, SAVE_SCALES: tl.constexpr):
    """out[b, t] = the pooled rows of table t's slots of sample b (module doc); ids [B, S] contiguous,
    out [B, T, D] contiguous; `table_offset[t]` is the buffer row of t's id 0."""
    t = tl.program_id(1)
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = b < batch
    start = tl.load(table_start_ptr + t).to(tl.int64)
    length = tl.load(table_length_ptr + t)
    mode = tl.load(table_mode_ptr + t)
    offset = tl.load(table_offset_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    first = ids_ptr + b * num_slots + start  # [BLOCK_B] each sample's first slot of t
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    count = tl.zeros([BLOCK_B], dtype=tl.float32)
    for k in range(length):
        ids = tl.load(first + k, mask=live, other=0).to(tl.int64)
        used = live & ((ids != 0) | (mode == ONE_ID))  # padding (id 0) of a bag contributes nothing
        rows = ids + offset
        vals = tl.load(weight_ptr + rows[:, None] * D + cols[None, :], mask=used[:, None] & col_ok[None, :],
                       other=0.0)
        acc += vals.to(tl.float32)
        count += used.to(tl.float32)
    if mode == MEAN:
        acc = acc / tl.maximum(count, 1.0)[:, None]  # an empty bag stays zeros
    out_at = out_ptr + (b * num_tables + t)[:, None] * D + cols[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])
    if SAVE_SCALES:
        share = tl.where(mode == MEAN, 1.0 / tl.maximum(count, 1.0), 1.0)  # [BLOCK_B]
        scales = scale_ptr + b * num_slots + start
        for k in range(length):
            ids = tl.load(first + k, mask=live, other=0)
            used = (ids != 0) | (mode == ONE_ID)
            tl.store(scales + k, tl.where(used, share, 0.0), mask=live)
