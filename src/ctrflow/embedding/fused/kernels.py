"""Triton kernels of the fused embedding path.

All tables live in one buffer `weight` [R, D] (table f starts at row `offsets[f]`). Three kernels:
`gather_rows_kernel` (forward: ids [N] -> rows [N, D]), `accumulate_segments_kernel` (backward:
per-position gradients summed into one fp32 row per distinct id, the ids sorted beforehand) and
`apply_update_kernel` (the optimizer step on each distinct row, which also re-zeroes the sums).
Multi-hot bags gather and pool in `bag_kernels.bag_forward_kernel`; their backward is the same
two kernels, each id slot's gradient read from its bag's (`accumulate_segments_kernel`'s BAGS).
`bucket_histogram_kernel` counts the host tier's cache slots by bucket and `write_rows_kernel` writes its
evicted rows into host memory (`ctrflow.embedding.fused.cache`).
No kernel reads a value back on the host, so a whole training step can be captured in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl

SGD, ROWWISE_ADAGRAD, ADAM = 0, 1, 2


@triton.jit
def gather_rows_kernel(ids_ptr, offsets_ptr, weight_ptr, out_ptr, n_items, num_features,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = weight[ids[n] + offsets[n % F]] for the BLOCK_N flattened (sample, feature) items."""
    items = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = items < n_items
    feature = items % num_features
    rows = tl.load(ids_ptr + items, mask=in_range, other=0).to(tl.int64)
    rows += tl.load(offsets_ptr + feature, mask=in_range, other=0)
    cols = tl.arange(0, BLOCK_D)
    mask = in_range[:, None] & (cols[None, :] < D)
    vals = tl.load(weight_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + items[:, None] * D + cols[None, :], vals.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def accumulate_segments_kernel(sorted_rows_ptr, order_ptr, slot_ptr, grad_ptr, acc_ptr, unique_rows_ptr,
                               weight_ptr, hyper_ptr, n_items, num_features, stride_b, stride_f, grad_scale,
                               slot_table_ptr, item_scale_ptr,
                               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                               PRE_REDUCE: tl.constexpr, GRAD_IS_BF16: tl.constexpr, DIRECT_SGD: tl.constexpr,
                               BAGS: tl.constexpr = False):
    """acc[slot[p]] += grad[order[p]] over BLOCK_N sorted positions p; unique_rows[slot[p]] = row.

    Positions are sorted by row, so one distinct row's positions are contiguous. With PRE_REDUCE the
    block first sums its positions per slot with a one-hot matrix product (a hot row then costs one
    atomic row per block instead of one per position). With DIRECT_SGD (needs PRE_REDUCE, fp32
    weights) the block adds -lr * its sums straight into the weight rows: SGD is linear, so partial
    sums may land in any order, and no sum buffer or update kernel is needed.
    grad is [B, F, D] with strides (stride_b, stride_f, 1): position n is (n // F, n % F); the sums
    are multiplied by `grad_scale` (1/world on the sharded path: the average over ranks, like DDP).
    With BAGS (multi-hot tables) positions are id slots (n // S, n % S), S = num_features, and grad
    is the pooled output's [B, T, D]: slot s reads its table's column slot_table[s], times its weight
    in the bag item_scale[n] (0 for padding, 1/count for a mean bag; `pooling.slot_scales`).
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK_N
    items = start + tl.arange(0, BLOCK_N)
    in_range = items < n_items
    src = tl.load(order_ptr + items, mask=in_range, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + items, mask=in_range, other=0).to(tl.int64)
    row = tl.load(sorted_rows_ptr + items, mask=in_range, other=0).to(tl.int64)
    if not DIRECT_SGD:
        # several positions write the same value to one slot: a benign race
        tl.store(unique_rows_ptr + slot, row, mask=in_range)
    cols = tl.arange(0, BLOCK_D)
    mask = in_range[:, None] & (cols[None, :] < D)
    column = src % num_features
    if BAGS:
        column = tl.load(slot_table_ptr + column, mask=in_range, other=0).to(tl.int64)
    src_at = (src // num_features) * stride_b + column * stride_f
    grad = tl.load(grad_ptr + src_at[:, None] + cols[None, :], mask=mask, other=0.0)
    if BAGS:
        share = tl.load(item_scale_ptr + src, mask=in_range, other=0.0)
        grad = grad.to(tl.float32) * share[:, None]
    if PRE_REDUCE:
        first = tl.load(slot_ptr + start).to(tl.int64)
        local = tl.where(in_range, slot - first, BLOCK_N)  # [BLOCK_N] in 0..BLOCK_N-1
        targets = tl.arange(0, BLOCK_N)
        onehot = (targets[:, None] == local[None, :]).to(tl.bfloat16)  # [BLOCK_N slots, BLOCK_N positions]
        high = grad.to(tl.bfloat16)
        sums = tl.dot(onehot, high, out_dtype=tl.float32)  # [BLOCK_N, BLOCK_D], exact for bf16 grads
        if not GRAD_IS_BF16:
            # fp32 grads: a second bf16 product of the remainder keeps ~16 mantissa bits
            low = (grad.to(tl.float32) - high.to(tl.float32)).to(tl.bfloat16)
            sums += tl.dot(onehot, low, out_dtype=tl.float32)
        sums = sums * grad_scale
        used = targets <= tl.max(tl.where(in_range, local, 0), axis=0)
        out_mask = used[:, None] & (cols[None, :] < D)
        if DIRECT_SGD:
            target_row = tl.max(tl.where(targets[:, None] == local[None, :], row[None, :], -1), axis=1)
            lr = tl.load(hyper_ptr)
            tl.atomic_add(weight_ptr + target_row[:, None] * D + cols[None, :], -lr * sums, mask=out_mask,
                          sem="relaxed")
        else:
            tl.atomic_add(acc_ptr + (first + targets)[:, None] * D + cols[None, :], sums, mask=out_mask,
                          sem="relaxed")
    else:
        tl.atomic_add(acc_ptr + slot[:, None] * D + cols[None, :], grad.to(tl.float32) * grad_scale, mask=mask,
                      sem="relaxed")


@triton.jit
def apply_update_kernel(unique_rows_ptr, count_ptr, acc_ptr, weight_ptr, state1_ptr, state2_ptr, hyper_ptr,
                        eps, beta1, beta2, l2, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_U: tl.constexpr,
                        OPTIMIZER: tl.constexpr, L2: tl.constexpr = False):
    """One optimizer step on the distinct rows slots [pid*BLOCK_U, +BLOCK_U) < count; zeroes acc there.

    hyper = [lr, step] (device memory, so that a captured graph sees a new learning rate).
    With L2 each row's summed gradient first becomes g + l2 w (`ctrflow.embedding.regularize`).
    SGD: w -= lr g. Row-wise Adagrad: s += mean(g^2); w -= lr g / (sqrt(s) + eps).
    Adam (lazy, torch.optim.SparseAdam's rule): m, v of touched rows only;
    w -= lr sqrt(1 - b2^step) / (1 - b1^step) m / (sqrt(v) + eps).
    """
    count = tl.load(count_ptr).to(tl.int64)
    slots = tl.program_id(0).to(tl.int64) * BLOCK_U + tl.arange(0, BLOCK_U)
    ok = slots < count
    cols = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (cols[None, :] < D)
    rows = tl.load(unique_rows_ptr + slots, mask=ok, other=0)
    acc_at = acc_ptr + slots[:, None] * D + cols[None, :]
    grad = tl.load(acc_at, mask=mask, other=0.0)
    w_at = weight_ptr + rows[:, None] * D + cols[None, :]
    w = tl.load(w_at, mask=mask, other=0.0).to(tl.float32)
    lr = tl.load(hyper_ptr)
    if L2:
        grad = grad + l2 * w
    if OPTIMIZER == 0:
        w = w - lr * grad
    elif OPTIMIZER == 1:
        s = tl.load(state1_ptr + rows, mask=ok, other=0.0) + tl.sum(grad * grad, axis=1) / D
        tl.store(state1_ptr + rows, s, mask=ok)
        w = w - lr * grad / (tl.sqrt(s)[:, None] + eps)
    else:
        step = tl.load(hyper_ptr + 1)
        m_at = state1_ptr + rows[:, None] * D + cols[None, :]
        v_at = state2_ptr + rows[:, None] * D + cols[None, :]
        m = tl.load(m_at, mask=mask, other=0.0)
        v = tl.load(v_at, mask=mask, other=0.0)
        m += (grad - m) * (1.0 - beta1)  # SparseAdam's association, for matching rounding
        v += (grad * grad - v) * (1.0 - beta2)
        tl.store(m_at, m, mask=mask)
        tl.store(v_at, v, mask=mask)
        correction1 = 1.0 - tl.exp(step * tl.log(beta1))
        correction2 = 1.0 - tl.exp(step * tl.log(beta2))
        w = w - (lr * tl.sqrt(correction2) / correction1) * m / (tl.sqrt(v) + eps)
    tl.store(w_at, w.to(weight_ptr.dtype.element_ty), mask=mask)
    # The sums' load may be laid out over the threads as the weight rows are (16-bit rows: another
    # layout than the zeros'), so a thread could zero an element that another has not loaded yet: a
    # lost update. The barrier orders every load of the tile before any zero.
    tl.debug_barrier()
    tl.store(acc_at, tl.zeros([BLOCK_U, BLOCK_D], dtype=tl.float32), mask=mask)


@triton.jit
def bucket_histogram_kernel(bucket_ptr, hist_ptr, n, BUCKETS: tl.constexpr, BLOCK: tl.constexpr):
    """hist[b] += the entries of bucket[:n] (int64, each in [0, BUCKETS)) equal to b. Each program counts
    its block in registers and adds BUCKETS sums: a histogram by per-element atomics piles millions of
    them on a few addresses (the host tier's victims, `ctrflow.embedding.fused.cache`, count some 10 M
    slots' buckets each batch, most of them in one or two)."""
    items = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = items < n
    counts = tl.histogram(tl.load(bucket_ptr + items, mask=live, other=0).to(tl.int32), BUCKETS)
    beyond = tl.sum((~live).to(tl.int32), axis=0)  # the lanes past n, counted in bucket 0
    buckets = tl.arange(0, BUCKETS)
    tl.atomic_add(hist_ptr + buckets, tl.where(buckets == 0, counts - beyond, counts))


@triton.jit
def write_rows_kernel(src_ptr, slots_ptr, dst_ptr, rows_ptr, count_ptr,
                      W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """dst[rows[i]] = src[slots[i]] (rows of W elements) for i < count[0]: the host tier's write-back,
    `dst` a host table registered with CUDA, written by the GPU through unified addressing
    (`ctrflow.embedding.fused.cache`). The count stays on the device; each program copies every
    grid-th block of BLOCK_N rows."""
    count = tl.load(count_ptr).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    for block in range(tl.program_id(0), tl.cdiv(count, BLOCK_N), tl.num_programs(0)):
        items = block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = items < count
        src = tl.load(slots_ptr + items, mask=live, other=0).to(tl.int64)
        dst = tl.load(rows_ptr + items, mask=live, other=0).to(tl.int64)
        mask = live[:, None] & (cols[None, :] < W)
        vals = tl.load(src_ptr + src[:, None] * W + cols[None, :], mask=mask, other=0)
        tl.store(dst_ptr + dst[:, None] * W + cols[None, :], vals, mask=mask)
