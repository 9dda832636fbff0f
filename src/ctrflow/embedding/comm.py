"""Collectives of the sharded embedding step, differentiable where gradients flow through them."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Function


def group_size(group) -> int:
    """World size of `group` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """all_to_all_single along dim 0: `in_splits[r]` rows go to rank r, `out_splits[r]` come from r
    (into `out` when given; one process: `x` itself, or copied into `out`)."""
    if group_size(group) == 1:
        return x if out is None else out.copy_(x)
    if out is None:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def exchange_async(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                   out: torch.Tensor | None = None):
    """`exchange` started on the communication stream: (output, work to `wait()` on before reading
    it, or None for one process)."""
    if group_size(group) == 1:
        return (x if out is None else out.copy_(x)), None
    if out is None:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    return out, work


class _Exchange(Function):
    """all_to_all whose backward sends gradients back the way the values came."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = exchange(x, out_splits, in_splits, group)
        return out.view_as(out) if out is x else out  # one process: no copy, but a new autograd output

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def exchange_differentiable(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """`exchange` with a backward pass (the reverse all-to-all)."""
    return _Exchange.apply(x, out_splits, in_splits, group)


class _ScaleGrad(Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by `scale` (averaging across ranks, like DDP)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class _ReplicatedLookup(Function):
    """Lookups in replicated tables; backward averages the gradients of all ranks.

    The gradient is summed densely per table (replicated tables are small) together with a
    count of touched rows, all tables in one all-reduce; the result is sparse over the rows any
    rank touched, so sparse optimizers see exactly the rows of the global batch.
    """

    @staticmethod
    def forward(ctx, group, divisor, n, *args):
        ids, weights = args[:n], args[n:]
        ctx.save_for_backward(*ids)
        ctx.group, ctx.divisor, ctx.shapes = group, divisor, [tuple(w.shape) for w in weights]
        return tuple(torch.nn.functional.embedding(i, w) for i, w in zip(ids, weights))

    @staticmethod
    def backward(ctx, *grads):
        ids = ctx.saved_tensors
        bufs = []
        for i, g, (rows, dim) in zip(ids, grads, ctx.shapes):
            buf = g.new_zeros(rows, dim + 1)  # [N, D | touch count]
            buf[:, :dim].index_add_(0, i, g)
            buf[:, dim].index_add_(0, i, g.new_ones(i.shape[0]))
            bufs.append(buf)
        flat = torch.cat([b.reshape(-1) for b in bufs])
        if group_size(ctx.group) > 1:
            dist.all_reduce(flat, group=ctx.group)
        out = []
        for buf, (rows, dim) in zip(flat.split([b.numel() for b in bufs]), ctx.shapes):
            buf = buf.view(rows, dim + 1)
            touched = (buf[:, dim] > 0).nonzero().squeeze(1)  # host sync: sparse sizes
            values = buf[touched, :dim] / ctx.divisor
            out.append(torch.sparse_coo_tensor(touched.unsqueeze(0), values, (rows, dim),
                                               is_coalesced=True, check_invariants=False))
        return (None, None, None, *([None] * len(ids)), *out)


def replicated_lookup(ids: list[torch.Tensor], weights: list[torch.Tensor], group, divisor: float) -> tuple:
    """Embeddings of `ids[k]` in `weights[k]` (full replicas); gradients summed over ranks / divisor."""
    return _ReplicatedLookup.apply(group, divisor, len(ids), *ids, *weights)
