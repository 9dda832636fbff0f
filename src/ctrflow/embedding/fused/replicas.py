"""Replicated (data-parallel) tables on the fused sharded path: gradients summed densely over ranks.

Replicated tables are the small ones (the fused planner replicates tables up to 32 MiB unless one moved
whole evens out the ranks' lookups), so each rank sums its batch's gradient into a dense fp32 buffer
([rows, D] sums, then a count of touches per row where the optimizer needs it), one all-reduce adds
every rank's, and every rank applies the same update to the rows any rank touched: the replicas stay
identical, and the result equals one process on the global batch. Masked over all rows instead of
gathering the touched ones: no device-to-host read (and the rows no rank touched are few: ~11% of the
MLPerf replicas' rows on 4 ranks of 65,536 Zipf samples). Summing and
all-reducing the large tables' part first, beside the rest's summing, was exact but slower (+0.08 ms a
step on 2 H200s, +0.12 ms on 4: benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch

from ctrflow.embedding.fused import ops
from ctrflow.embedding.regularize import regularized
from ctrflow.embedding.fused.collection import FusedEmbeddingCollection


def replicated_grad(ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor, num_rows: int,
                    scratch: dict, counts: bool = True, out: torch.Tensor | None = None,
                    presorted: tuple | None = None, bags: tuple | None = None) -> torch.Tensor:
    """[num_rows * (D + 1)] fp32: grad [b, n, D] of ids [b, n] (rows ids + offsets of the replica
    buffer) summed per row ([num_rows, D] first), then the number of lookups of each row (left
    zero without `counts`: SGD on fp32 replicas needs no mask, see `needs_counts`); added to `out`
    when given (a step's micro-batches share one buffer); `presorted`: `ops.sort_rows` of ids + offsets;
    `bags`: ids are bags' slots and grad the pooled vectors' [b, T, D] (`ops.update_rows`'s `bags`).

    The sums use the fused kernels (sorted, pre-reduced per block: tiny tables' rows are hit by
    most of the batch, and an atomic add per lookup would serialize) as an SGD step of rate -1 on a
    zeroed buffer.
    """
    dim = grad.shape[-1]
    buf = torch.zeros(num_rows * (dim + 1), dtype=torch.float32, device=grad.device) if out is None else out
    sums = buf[:num_rows * dim].view(num_rows, dim)
    if "add" not in scratch:
        one = torch.zeros(1, device=grad.device)
        scratch["add"] = ops.RowState("sgd", torch.tensor([-1.0, 0.0], device=grad.device), one, one)
    if ids.numel():
        ops.update_rows(ids, offsets, grad, sums, scratch["add"], scratch, presorted=presorted, bags=bags)
    if ids.numel() and counts:
        # index_add reads nothing back (bincount does: its size), so the step can be captured; histc
        # is no substitute: its float bin arithmetic misplaces ids beyond ~2^24 / bins
        rows = (ids + offsets).reshape(-1)
        buf[num_rows * dim:].index_add_(0, rows, torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device))
    return buf


def needs_counts(replica: FusedEmbeddingCollection) -> bool:
    """Whether the update needs the touch counts: Adam's moments, and the L2, change touched rows only;
    SGD and row-wise Adagrad on fp32 replicas without the L2 add exactly zero to the weights and the
    sums of squares of rows no rank touched."""
    st = replica.row_state
    return not (st.optimizer in ("sgd", "rowwise_adagrad") and replica.weight.dtype == torch.float32 and not st.l2)


@torch.no_grad()
def apply_replicated(acc: torch.Tensor, replica: FusedEmbeddingCollection, world: int) -> None:
    """One optimizer step of the replica from the all-reduced `acc`: gradient = sum / world (+ the L2,
    `regularize`) on the rows some rank touched (the fused kernels' rules: SGD, row-wise Adagrad, lazy Adam)."""
    st, weight = replica.row_state, replica.weight
    rows, dim = weight.shape
    sums = acc[:rows * dim].view(rows, dim)
    if not needs_counts(replica):  # untouched rows have zero sums; two passes over the rows, not eight
        if st.optimizer == "sgd":
            weight.addcmul_(sums, st.hyper[0], value=-1.0 / world)
            return
        # s += mean((sums / world)^2); w -= lr (sums / world) / (sqrt(s) + eps)
        st.state1.add_(torch.linalg.vector_norm(sums, dim=1).square_(), alpha=1.0 / (dim * world * world))
        rate = (st.hyper[0] / world) / (st.state1.sqrt() + st.eps)
        weight.addcmul_(sums, rate.unsqueeze(1), value=-1.0)
        return
    touched = acc[rows * dim:] > 0  # [R]
    lr = st.hyper[0]
    w = weight.float()
    grad = regularized(sums / world, w, st.l2)  # untouched rows' results are discarded below
    if st.optimizer == "sgd":
        new = w - lr * grad
    elif st.optimizer == "rowwise_adagrad":
        s = torch.where(touched, st.state1 + grad.pow(2).mean(dim=1), st.state1)
        st.state1.copy_(s)
        new = w - lr * grad / (s.sqrt().unsqueeze(1) + st.eps)
    else:
        st.hyper[1].add_(1.0)
        mask = touched.unsqueeze(1)
        m = torch.where(mask, st.state1 + (grad - st.state1) * (1 - st.beta1), st.state1)
        v = torch.where(mask, st.state2 + (grad * grad - st.state2) * (1 - st.beta2), st.state2)
        st.state1.copy_(m)
        st.state2.copy_(v)
        step = st.hyper[1]
        correction1, correction2 = 1 - st.beta1 ** step, 1 - st.beta2 ** step
        new = w - (lr * correction2.sqrt() / correction1) * m / (v.sqrt() + st.eps)
    weight.copy_(torch.where(touched.unsqueeze(1), new, w).to(weight.dtype))
