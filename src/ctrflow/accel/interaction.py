"""`FusedDotInteraction`: DLRM's interaction in one Triton kernel each way.

Same function as `ctrflow.models.layers.DotInteraction` (dense [B, D] and embeddings [B, F-1, D] ->
[B, D + F(F-1)/2 + pad] = [dense, pairs i < j in row-major order, zeros]). The plain version
concatenates the F vectors, runs a batched matmul, gathers the upper triangle (an index-put with
accumulation in backward: several ms at batch 65,536) and concatenates again. Here each sample's
Gram matrix lives only in registers: forward reads dense and embeddings once and writes the top
MLP's whole input row (dense copy, pairs, zero pad); backward reads them and the row's gradient once
and writes d_dense = grad[:D] + ((G + G^T) x)[0] and d_embeddings = ((G + G^T) x)[1:].

`embedding_rows` (optional, [3, F-1] int64) lets it read the embeddings where a sharded collection's
exchange left them (`FusedShardedEmbeddingCollection.exchange_rows`): feature f of sample b is row
batch * rows[0, f] + b * rows[1, f] + rows[2, f] of the [batch * (F-1), D] buffer, and its gradient
goes to the same row, so neither direction needs a copy into or out of [B, F-1, D].

Speed comes from how many programs share an SM (registers) and from few layout changes: x is one
load (dense row and embeddings through one pointer select), the row map is 1-D (a [FP, 1] map was
replicated 8-fold per thread: 181 registers instead of 94), the backward reads (G + G^T) directly
(G[min, max]: no transpose) and adds grad[:D] as a [D] row. `benchmarks/interaction_layout.py`
prints each kernel's time, registers and spills.
"""

from __future__ import annotations

import torch

from ctrflow.embedding.fused import ops
from ctrflow.models.layers import DotInteraction

if ops.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _pair_index(F: tl.constexpr, FP: tl.constexpr):
        i = tl.arange(0, FP)[:, None]
        j = tl.arange(0, FP)[None, :]
        pos = i * (2 * F - i - 1) // 2 + (j - i - 1)  # row-major index of pair (i, j), i < j
        return pos, (i < j) & (j < F)

    @triton.jit
    def _row_map(map_ptr, batch, F: tl.constexpr, FP: tl.constexpr, MAPPED: tl.constexpr):
        """([FP] sample 0's buffer row of each feature's vector (-1 for the dense one), [FP] the rows
        from one sample to the next): 1-D, one copy per thread's rows, read once per program."""
        f = tl.arange(0, FP)
        if MAPPED:
            k = tl.maximum(f - 1, 0)
            live = (f >= 1) & (f < F)
            first = batch * tl.load(map_ptr + k, mask=live, other=0) + tl.load(map_ptr + 2 * (F - 1) + k, mask=live,
                                                                                   other=0)
            step = tl.load(map_ptr + (F - 1) + k, mask=live, other=0)
            first, step = first.to(tl.int32), step.to(tl.int32)
        else:
            first = (f - 1).to(tl.int64)
            step = tl.zeros([FP], dtype=tl.int64) + (F - 1)
        return first, step

    @triton.jit
    def _sample_rows(first, step, b, MAPPED: tl.constexpr):
        """[FP, 1] sample b's buffer rows (from `_row_map`; int32 with MAPPED: fewer registers, and
        `FusedDotInteraction` maps only buffers of fewer than 2^31 elements)."""
        if MAPPED:
            rows = first + b.to(tl.int32) * step
        else:
            rows = b * step + first
        return rows[:, None]

    @triton.jit
    def _load_features(dense_ptr, emb_ptr, b, rows, F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr):
        """x [FP, D]: row 0 the sample's dense vector, rows 1..F-1 its embeddings (buffer rows
        `rows` [FP, 1]), the rest zero; one load (one layout change on its way to the product)."""
        f = tl.arange(0, FP)[:, None]
        cols = tl.arange(0, D)[None, :]
        ptr = tl.where(f == 0, dense_ptr + b * D + cols, emb_ptr + rows * D + cols)
        return tl.load(ptr, mask=(f < F) & (cols < D), other=0.0)

    @triton.jit
    def interaction_kernel(dense_ptr, emb_ptr, map_ptr, out_ptr, batch, F: tl.constexpr, FP: tl.constexpr,
                           D: tl.constexpr, PAIRS: tl.constexpr, W: tl.constexpr, PADP: tl.constexpr,
                           SAMPLES: tl.constexpr, IEEE: tl.constexpr, MAPPED: tl.constexpr):
        """out[b] = [dense[b], upper triangle (i < j) of x x^T, zeros up to W] for SAMPLES samples b."""
        cols = tl.arange(0, D)
        tail = D + PAIRS + tl.arange(0, PADP)
        pos, valid = _pair_index(F, FP)
        row0, row_step = _row_map(map_ptr, batch, F, FP, MAPPED)
        for s in range(SAMPLES):
            b = tl.program_id(0).to(tl.int64) * SAMPLES + s
            if b < batch:
                rows = _sample_rows(row0, row_step, b, MAPPED)
                x = _load_features(dense_ptr, emb_ptr, b, rows, F, FP, D)
                if IEEE:
                    gram = tl.dot(x, tl.trans(x), input_precision="ieee")
                else:
                    gram = tl.dot(x, tl.trans(x))
                row = out_ptr + b * W
                tl.store(row + D + pos, gram.to(out_ptr.dtype.element_ty), mask=valid)
                tl.store(row + cols, tl.load(dense_ptr + b * D + cols).to(out_ptr.dtype.element_ty))
                tl.store(row + tail, tl.zeros([PADP], dtype=out_ptr.dtype.element_ty), mask=tail < W)

    @triton.jit
    def interaction_backward_kernel(dense_ptr, emb_ptr, map_ptr, grad_ptr, ddense_ptr, demb_ptr, grad_stride,
                                    batch, F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr,
                                    SAMPLES: tl.constexpr, IEEE: tl.constexpr, MAPPED: tl.constexpr):
        """dx = (G + G^T) x, G [F, F] the pair gradients placed at (i, j), i < j; row 0 of dx plus
        grad[b, :D] is d_dense[b], rows 1.. are d_embeddings[b] (grad rows `grad_stride` apart)."""
        f = tl.arange(0, FP)[:, None]
        cols = tl.arange(0, D)[None, :]
        i, j = f, tl.arange(0, FP)[None, :]
        lo, hi = tl.minimum(i, j), tl.maximum(i, j)
        spos = lo * (2 * F - lo - 1) // 2 + (hi - lo - 1)  # (G + G^T)[i, j] = G[lo, hi]: no transpose
        sval = (i != j) & (hi < F)
        row0, row_step = _row_map(map_ptr, batch, F, FP, MAPPED)
        for s in range(SAMPLES):
            b = tl.program_id(0).to(tl.int64) * SAMPLES + s
            if b < batch:
                rows = _sample_rows(row0, row_step, b, MAPPED)
                x = _load_features(dense_ptr, emb_ptr, b, rows, F, FP, D)
                sym = tl.load(grad_ptr + b * grad_stride + D + spos, mask=sval, other=0.0).to(x.dtype)
                if IEEE:
                    dx = tl.dot(sym, x, input_precision="ieee")
                else:
                    dx = tl.dot(sym, x)
                first = f == 0
                dense_grad = tl.load(grad_ptr + b * grad_stride + tl.arange(0, D)).to(tl.float32)
                dx += tl.where(first, dense_grad[None, :], 0.0)
                tl.store(ddense_ptr + b * D + cols + f * 0, dx.to(ddense_ptr.dtype.element_ty), mask=first)
                tl.store(demb_ptr + rows * D + cols, dx.to(demb_ptr.dtype.element_ty), mask=(f >= 1) & (f < F))


_SAMPLES = 8  # samples per program
_WARPS = 4
# registers per thread of the MAPPED backward: 96 lets 5 programs share an SM (110 unbounded: 4)
_MAPPED_BACKWARD_REGS = 96


def launch_options(mapped: bool, backward: bool) -> dict:
    """The kernels' launch options (warps, and a register bound for the mapped backward)."""
    if mapped and backward and _MAPPED_BACKWARD_REGS:
        return {"num_warps": _WARPS, "maxnreg": _MAPPED_BACKWARD_REGS}
    return {"num_warps": _WARPS}


def _block(features: int) -> int:
    return max(16, triton.next_power_of_2(features))


class _Interact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dense: torch.Tensor, embedded: torch.Tensor, width: int, rows: torch.Tensor | None):
        dense, embedded = dense.contiguous(), embedded.contiguous()
        batch, others, dim = embedded.shape  # with `rows`: the buffer viewed as [B, F-1, D]
        features = others + 1
        pairs = features * (features - 1) // 2
        out = torch.empty(batch, width, dtype=embedded.dtype, device=embedded.device)
        interaction_kernel[(triton.cdiv(batch, _SAMPLES),)](
            dense, embedded, dense if rows is None else rows, out, batch, F=features, FP=_block(features), D=dim,
            PAIRS=pairs, W=width, PADP=triton.next_power_of_2(max(width - dim - pairs, 1)), SAMPLES=_SAMPLES,
            IEEE=embedded.dtype == torch.float32, MAPPED=rows is not None, **launch_options(rows is not None, False))
        ctx.save_for_backward(dense, embedded)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dense, embedded = ctx.saved_tensors
        batch, others, dim = embedded.shape
        if grad.stride(1) != 1:
            grad = grad.contiguous()
        d_dense, d_embedded = torch.empty_like(dense), torch.empty_like(embedded)
        rows = ctx.rows
        interaction_backward_kernel[(triton.cdiv(batch, _SAMPLES),)](
            dense, embedded, dense if rows is None else rows, grad, d_dense, d_embedded, grad.stride(0), batch,
            F=others + 1, FP=_block(others + 1), D=dim, SAMPLES=_SAMPLES, IEEE=embedded.dtype == torch.float32,
            MAPPED=rows is not None, **launch_options(rows is not None, True))
        return d_dense, d_embedded, None, None


class FusedDotInteraction(DotInteraction):
    """Drop-in for `DotInteraction(num_features, dim, pad_multiple)` (torch path off CUDA).

    Needs D a power of two of at least 16 (a Triton block); other shapes take the torch path.
    `read_rows(rows)` makes it read embeddings laid out by `rows` (module docstring); None undoes it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("embedding_rows", None, persistent=False)

    def read_rows(self, rows: torch.Tensor | None) -> None:
        """Read the embeddings as `rows` ([3, F-1] int64: batch scale, sample stride, first row) lays
        them out, or as [B, F-1, D] (None)."""
        self.embedding_rows = None if rows is None else rows.to(torch.int64).contiguous()

    @classmethod
    def from_plain(cls, plain: DotInteraction) -> "FusedDotInteraction":
        """The fused twin of a model's own interaction (no weights to copy)."""
        return cls(plain.num_features, plain.dim, plain.pad_multiple)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        dim, rows = embedded.shape[2], self.embedding_rows
        fits = rows is None or embedded.numel() < 2**31  # the mapped kernels' row offsets are int32
        if not (ops.uses_kernels(embedded) and dim >= 16 and dim & (dim - 1) == 0 and fits):
            if rows is not None:  # [B, F-1] buffer row of each embedding, then the plain layer
                b = embedded.shape[0]
                at = torch.arange(b, device=embedded.device).unsqueeze(1)
                embedded = embedded.reshape(-1, dim)[b * rows[0] + at * rows[1] + rows[2]]
            return super().forward(dense, embedded)
        if torch.is_autocast_enabled(embedded.device.type):
            dtype = torch.get_autocast_dtype(embedded.device.type)  # as bmm under autocast
        else:
            dtype = torch.promote_types(dense.dtype, embedded.dtype)
        return _Interact.apply(dense.to(dtype), embedded.to(dtype), self.out_features, rows)
