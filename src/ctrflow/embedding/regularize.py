"""The embedding L2: a penalty on the rows a batch touches, applied inside the optimizers' update.

After a step's gradient of each distinct row is summed (duplicate ids, micro-batches, ranks), and
before the optimizer's rule, every touched row's gradient becomes

    g_r + l2 * w_r

(coupled L2, FBGEMM's "L2" weight-decay mode; `torch.optim.Adam`'s `weight_decay` restricted to the
touched rows). Rows the batch did not touch are left alone, so it costs no pass over a table: one
multiply-add per updated element. `l2` is per step against the mean loss: a row seen once in a batch
of 2,048 has a data gradient of norm ~1e-4, so 1e-2 weighs on rarely seen rows and hardly on frequent
ones (benchmarks/quality.md). Every path applies this rule: the plain sparse optimizers
(`ctrflow.embedding.optimizers`), the fused update (`fused.ops.apply_reference` and its Triton kernel
`fused.kernels.apply_update_kernel`), the replicated tables of the fused sharded path
(`fused.replicas.apply_replicated`), each on the rank that owns the row after the gradients are
exchanged and averaged. Column-wise shards add it on their own columns before row-wise Adagrad sums
a row's squares over the shards. A multi-hot table's padding row starts at zero and gets no
gradient (`collection.zero_padding_row`), so it stays zero whether a path touches it or not.
"""

from __future__ import annotations

import torch


def regularized(grad: torch.Tensor, weight_rows: torch.Tensor, l2: float) -> torch.Tensor:
    """`grad + l2 * weight_rows` (fp32; a new tensor), or `grad` itself when `l2` is 0: the summed
    gradient [U, D] of distinct rows whose current weights are `weight_rows` [U, D]."""
    if not l2:
        return grad
    return grad + l2 * weight_rows.float()
