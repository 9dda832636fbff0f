"""Host side of the fused path: launch the Triton kernels on CUDA, the same algorithm in torch elsewhere.

`lookup` gathers [B, F] ids from the one buffer of all tables; `update_rows` sums the gradient of
each distinct row of a batch and applies the optimizer to it, without a sparse gradient tensor and
without a device-to-host read (so it can run inside a captured CUDA graph). Multi-hot bags:
`ctrflow.embedding.fused.bags`, on the same update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # the kernel compiler exists only where CUDA does (an import error leaves the torch path)
    import triton

    from ctrflow.embedding.fused import kernels
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    kernels = None

OPTIMIZERS = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}


@dataclass
class RowState:
    """Optimizer state of the fused tables: `hyper` = [lr, step] (fp32, on the weights' device);
    `state1` ([R] row-wise Adagrad sums, or [R, D] Adam first moments), `state2` ([R, D] Adam second
    moments); a one-element placeholder where the optimizer has none."""

    optimizer: str
    hyper: torch.Tensor
    state1: torch.Tensor
    state2: torch.Tensor
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999


def uses_kernels(weight: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like `weight` (CUDA and Triton present)."""
    return weight.is_cuda and kernels is not None


def lookup(ids: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [B, F] -> rows [B, F, D] of `weight` (row ids[b, f] + offsets[f]), cast to `out_dtype`
    (written into `out`, a contiguous [B, F, D] tensor, when given). Also a generic row gather."""
    batch, features = ids.shape
    dim = weight.shape[1]
    if out is None:
        out = torch.empty(batch, features, dim, dtype=out_dtype, device=weight.device)
    if not uses_kernels(weight):
        out.copy_(weight[(ids + offsets).reshape(-1)].view(batch, features, dim))
        return out
    ids = ids.contiguous()
    n_items = batch * features
    if n_items == 0:
        return out
    block_n = 32
    kernels.gather_rows_kernel[(triton.cdiv(n_items, block_n),)](
        ids, offsets, weight, out, n_items, features, D=dim, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_N=block_n, num_warps=4)
    return out


def sort_rows(rows: torch.Tensor, num_rows: int) -> tuple:
    """What the GPU update derives from the ids alone, rows [N] of a buffer of `num_rows` rows: (the
    sorted rows, their positions, each position's distinct-row number, the distinct count [1] on the
    device); computed ahead (e.g. while an exchange travels) and handed to `update_rows`."""
    # int32 keys sort in half the passes of int64 ones
    keys = rows.to(torch.int32) if num_rows < 2**31 else rows
    sorted_rows, order = torch.sort(keys)
    is_new = torch.ones_like(sorted_rows, dtype=torch.int32)
    is_new[1:] = sorted_rows[1:] != sorted_rows[:-1]
    slot = torch.cumsum(is_new, 0, dtype=torch.int32) - 1  # [N] index of each position's distinct row
    return sorted_rows, order, slot, slot[-1:] + 1


def update_rows(ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor,
                state: RowState, scratch: dict, pre_reduce: bool = True, grad_scale: float = 1.0,
                presorted: tuple | None = None, bags: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Apply one optimizer step to the rows of `weight` that `ids` [B, F] touched, given grad [B, F, D]
    times `grad_scale`.

    Repeated rows are summed first (as a sparse gradient would be), then stepped once.
    `scratch` keeps the fp32 sum buffer between calls (the update kernel leaves it zeroed).
    `presorted`: `sort_rows` of these ids' rows, done earlier (used by the GPU kernels).
    `bags` (multi-hot, `bags.update_bags`): (slot_table [S] int32, scales [B, S] fp32); `ids` are
    then [B, S] id slots, `offsets` [S] and grad [B, T, D] the pooled output's: slot s's gradient is
    grad[:, slot_table[s]] * scales[:, s] (never made on the GPU: the kernels read it so).
    """
    rows = (ids + offsets).reshape(-1)
    if state.optimizer == "adam":
        state.hyper[1].add_(1.0)
    if uses_kernels(weight):
        _update_rows_triton(rows, ids.shape[1], grad, weight, state, scratch, pre_reduce, grad_scale, presorted,
                            bags)
        return
    if bags is not None:
        grad = grad.float().index_select(1, bags[0].long()) * bags[1].unsqueeze(2)  # [B, S, D]
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = torch.zeros(unique.numel(), weight.shape[1], dtype=torch.float32, device=grad.device)
    summed.index_add_(0, inverse, grad.reshape(-1, weight.shape[1]).float())
    if grad_scale != 1.0:
        summed.mul_(grad_scale)
    apply_reference(unique, summed, weight, state)


def _update_rows_triton(rows: torch.Tensor, features: int, grad3: torch.Tensor, weight: torch.Tensor,
                        state: RowState, scratch: dict, pre_reduce: bool, grad_scale: float = 1.0,
                        presorted: tuple | None = None, bags: tuple | None = None) -> None:
    """`update_rows` on the GPU: rows [N] (global), grad3 [B, F, D], maybe a strided view (a slice
    of the interaction's input gradient; with `bags`, F is the slots and grad3 [B, T, D]). Sort,
    number the distinct rows, two kernels (one for SGD)."""
    dim = weight.shape[1]
    sorted_rows, order, slot, count = presorted if presorted is not None else sort_rows(rows, weight.shape[0])
    n_items = rows.numel()
    direct = pre_reduce and state.optimizer == "sgd" and weight.dtype == torch.float32
    acc = weight if direct else scratch.get("acc")  # direct SGD needs no sum buffer
    # (not even when `weight` has fewer rows than items: a replica's sums took a 604 MB zero fill a step)
    if not direct and (acc is None or acc.shape[0] < n_items or acc.shape[1] != dim or acc.device != weight.device):
        acc = scratch["acc"] = torch.zeros(n_items, dim, dtype=torch.float32, device=weight.device)
    unique_rows = torch.empty(n_items, dtype=torch.int64, device=weight.device)
    block_d = triton.next_power_of_2(dim)
    if grad3.stride(2) != 1:
        grad3 = grad3.contiguous()
    block_n = 64 if pre_reduce else 32
    slot_table, scales = bags if bags is not None else (slot, slot)  # unread without BAGS: any valid pointer
    kernels.accumulate_segments_kernel[(triton.cdiv(n_items, block_n),)](
        sorted_rows, order, slot, grad3, acc, unique_rows, weight, state.hyper, n_items, features,
        grad3.stride(0), grad3.stride(1), float(grad_scale), slot_table, scales, D=dim, BLOCK_D=block_d,
        BLOCK_N=block_n, PRE_REDUCE=pre_reduce,
        # a bag's scaled gradient is fp32 whatever the output's dtype
        GRAD_IS_BF16=grad3.dtype == torch.bfloat16 and bags is None, DIRECT_SGD=direct, BAGS=bags is not None,
        num_warps=4)
    if direct:
        return
    block_u = 16
    # no tile element held by two warps (a tile smaller than the warps is copied over them)
    warps = max(1, min(4, block_u * block_d // 128))
    kernels.apply_update_kernel[(triton.cdiv(n_items, block_u),)](
        unique_rows, count, acc, weight, state.state1, state.state2, state.hyper, state.eps, state.beta1,
        state.beta2, D=dim, BLOCK_D=block_d, BLOCK_U=block_u, OPTIMIZER=OPTIMIZERS[state.optimizer],
        num_warps=warps)


def apply_reference(rows: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, state: RowState) -> None:
    """The update rule of `apply_update_kernel` in torch: distinct `rows` [U], summed grad [U, D] fp32."""
    lr = state.hyper[0]
    w = weight[rows].float()
    if state.optimizer == "sgd":
        w = w - lr * grad
    elif state.optimizer == "rowwise_adagrad":
        s = state.state1[rows] + grad.pow(2).mean(dim=1)
        state.state1[rows] = s
        w = w - lr * grad / (s.sqrt().unsqueeze(1) + state.eps)
    else:
        step = state.hyper[1]
        m = state.state1[rows]
        v = state.state2[rows]
        m = m + (grad - m) * (1 - state.beta1)
        v = v + (grad * grad - v) * (1 - state.beta2)
        state.state1[rows] = m
        state.state2[rows] = v
        correction1 = 1 - state.beta1 ** step
        correction2 = 1 - state.beta2 ** step
        w = w - (lr * correction2.sqrt() / correction1) * m / (v.sqrt() + state.eps)
    weight[rows] = w.to(weight.dtype)
