"""The backward half of `FusedShardedEmbeddingCollection` (`sharded.py`): each step's gradients sent
back to the shard owners and the replicas' summed over ranks, both started asynchronously, then ONE
optimizer update a step from every micro-batch's gradients, applied at the end of backward (an autograd
callback) or by the caller's `flush()` (`update_in_backward = False`, e.g. after it started its own
all-reduce of the dense gradients, which then runs beside the update). `flush()` also runs before the
next lookup, so no lookup ever reads a table whose update is pending.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ctrflow.embedding.comm import exchange_async
from ctrflow.embedding.fused import ops
from ctrflow.embedding.fused.replicas import apply_replicated, needs_counts, replicated_grad
from ctrflow.embedding.fused.routing import finish_route, pack_index


class DeferredUpdate:
    """Mixin of the fused sharded collection (attributes `layout`, `tables`, `embedding_dim`, `group`,
    `world_size`, `local`, `replica`, `cache`, `pending`, `ahead`, `next_route`, `raw_output`,
    `update_in_backward`, `overlap`, `model_parallel`, `output_dtype`, buffers `rep_index`, `zero_offset`,
    and method `local_device`)."""

    def start_backward(self, grad: torch.Tensor, saved: tuple) -> None:
        """Send the gradients to the shard owners (into the step's one receive buffer) and sum the
        replicas' (over the step's chunks, then over ranks), all started asynchronously; the update
        runs at the end of the backward pass, or now for one process and one chunk."""
        ids, r, step, c = saved
        lay, dim, b = self.layout, self.embedding_dim, ids.shape[0]
        rows = grad.to(self.output_dtype).reshape(-1, dim)  # [b * F, D]
        if self.raw_output:  # already in the order the ids were sent, replicated features last
            packed = rows
        else:
            index = pack_index(lay, r, len(self.tables), ids.device, self.cache)
            packed = ops.lookup(index.view(-1, 1), self.zero_offset, rows, self.output_dtype).view(-1, dim)
        n_send = sum(r.send)
        if self.model_parallel:
            if step["grad"] is None:
                step["grad"] = rows.new_empty(step["bounds"][-1], dim)
            lo, hi = step["bounds"][c], step["bounds"][c + 1]
            _, work = exchange_async(packed[:n_send], r.recv, r.send, self.group, out=step["grad"][lo:hi])
            step["works"].append(work)
        if self.replica is not None:
            rep = self.replica
            step["rep_acc"] = replicated_grad(ids.index_select(1, self.rep_index), rep.offsets,
                                              packed[n_send:].view(b, len(lay.rep), dim), rep.weight.shape[0],
                                              self.cache, counts=needs_counts(rep), out=step["rep_acc"],
                                              presorted=step["rep_sorted"][c])
        step["arrived"] += 1
        if step["arrived"] < step["chunks"]:
            return  # the last chunk's backward queues the update
        if self.replica is not None and self.world_size > 1:
            # on the default group's communicator: beside the all-to-all, not behind it
            whole = self.world_size == dist.get_world_size()
            step["rep_work"] = dist.all_reduce(step["rep_acc"], group=None if whole else self.group, async_op=True)
        self.pending.append(step)
        if not self.update_in_backward:
            return  # the caller's `flush()` (or the next lookup) applies it
        if (self.world_size > 1 and self.overlap) or step["chunks"] > 1:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        else:
            self.flush()

    def _replica_sums(self) -> torch.Tensor:
        """The zeroed [rows * (D + 1)] fp32 buffer of `replicated_grad` (one, reused every step)."""
        buf = self.cache.get("rep_acc")
        if buf is None:
            rows = self.replica.weight.shape[0]
            buf = self.cache["rep_acc"] = torch.empty(rows * (self.embedding_dim + 1), dtype=torch.float32,
                                                      device=self.local_device())
        return buf.zero_()

    def flush(self) -> None:
        """Apply the pending update of the last backward (waits for its exchanges), then finish the
        next step's routing if `prefetch(next_ids=...)` started it; no-op if neither."""
        pending, self.pending = self.pending, []
        for step in pending:
            self._apply_update(step)
        if self.ahead is not None:  # after the update: its rows buffer is the one written here
            (r, work), self.ahead = self.ahead, None
            out = self.cache.get(("ahead", r.rows.numel()))
            if out is None:
                out = self.cache["ahead", r.rows.numel()] = torch.empty_like(r.rows)
            offsets = self.local.offsets if self.local is not None else None
            self.next_route = finish_route(r, work, self.layout, offsets, self.cache, out)

    def _apply_update(self, step: dict) -> None:
        """One optimizer step from every chunk's gradients: owned rows (while the replicas'
        all-reduce still runs), then the replicas."""
        for work in step["works"]:
            if work is not None:  # None: one process
                work.wait()
        if self.model_parallel and step["rows"].numel():
            local = self.local
            ops.update_rows(step["rows"].view(-1, 1), self.zero_offset,
                            step["grad"].view(-1, 1, self.embedding_dim), local.weight, local.row_state,
                            local.scratch, local.pre_reduce, grad_scale=1.0 / self.world_size,
                            presorted=step["sorted"])
        if step["rep_work"] is not None:
            step["rep_work"].wait()
        if step["rep_acc"] is not None:
            apply_replicated(step["rep_acc"], self.replica, self.world_size)
