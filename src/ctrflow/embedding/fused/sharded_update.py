"""The backward half of `FusedShardedEmbeddingCollection` (`sharded.py`): each step's gradients sent
back to the shard owners and the replicas' summed over ranks, both started asynchronously, then ONE
optimizer update a step from every micro-batch's gradients, applied at the end of backward (an autograd
callback) or by the caller's `flush()` (`update_in_backward = False`, e.g. after it started its own
all-reduce of the dense gradients, which then runs beside the update). `flush()` also runs before the
next lookup, so no lookup ever reads a table whose update is pending. On several GPUs with a flushing
caller, the tables' own work (forward's sorts, the replicas' sums and all-reduce, the update) runs on a
side stream, so the bottom MLP's layers are not queued behind it (4 H200s: -0.2 ms a step, benchmarks/NOTES.md).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ctrflow.embedding.comm import exchange_async
from ctrflow.embedding.fused import bags, ops
from ctrflow.embedding.fused.placement import pack_index, scale_row_means
from ctrflow.embedding.fused.replicas import apply_replicated, needs_counts, replicated_grad
from ctrflow.embedding.fused.routing import finish_route
from ctrflow.streams import beside, side_stream


class DeferredUpdate:
    """Mixin of the fused sharded collection (attributes `layout`, `tables`, `embedding_dim`, `group`,
    `world_size`, `local`, `replica`, `cache`, `pending`, `ahead`, `next_route`, `raw_output`,
    `update_in_backward`, `overlap`, `beside`, `model_parallel`, `output_dtype`, buffers `rep_index`,
    `rep_bag_slot_table`, `zero_offset`, and methods `local_device`, `rep_offsets`)."""

    def _side(self) -> torch.cuda.Stream | None:
        """The stream of the tables' own work beside the dense layers' (`beside`: several CUDA ranks
        whose caller flushes), or None: that work then queues on the current stream."""
        if not (self.beside and not self.update_in_backward and self.world_size > 1
                and self.local_device().type == "cuda"):
            return None
        return side_stream(self.local_device(), "sharded_tables")

    @contextmanager
    def _beside(self, *inputs: torch.Tensor):
        """`ctrflow.streams.beside` on `_side()`; `flush()` joins."""
        side = self._side()
        if side is not None:
            self.cache["side_used"] = True
        with beside(side, *inputs):
            yield

    def _join_side(self) -> None:
        """The current stream waits for the side stream's work (a CUDA graph needs it joined)."""
        if self.cache.pop("side_used", False):
            torch.cuda.current_stream().wait_stream(self._side())

    def start_backward(self, grad: torch.Tensor, saved: tuple) -> None:
        """Send the gradients to the shard owners (into the step's one receive buffer) and sum the
        replicas' (over the step's chunks, then over ranks), all started asynchronously; the update
        runs at the end of the backward pass, or now for one process and one chunk."""
        ids, r, step, c = saved
        lay, dim, b = self.layout, self.embedding_dim, ids.shape[0]
        if lay.bag_rows:  # a row-split mean bag was divided here, after its partial sums came
            grad = scale_row_means(grad, lay, ids)
        rows = grad.to(self.output_dtype).reshape(-1, dim)  # [b * T, D]
        if self.raw_output:  # already in the order the ids were sent, replicated features last
            packed = rows
        else:
            index = pack_index(lay, r, len(self.tables), ids.device, self.cache)
            packed = ops.lookup(index.view(-1, 1), self.zero_offset, rows, self.output_dtype).view(-1, dim)
        n_send = sum(r.back_in)
        if self.model_parallel:
            if step["grad"] is None:  # one gradient row per vector this rank returned
                step["grad"] = rows.new_empty(step["back"][-1], dim)
            lo, hi = step["back"][c], step["back"][c + 1]
            _, work = exchange_async(packed[:n_send], r.back_out, r.back_in, self.group, out=step["grad"][lo:hi])
            step["works"].append(work)
        last = step["arrived"] + 1 == step["chunks"]
        if self.replica is not None:
            rep = self.replica
            rep_ids = step["rep_ids"][c]
            scales = step["rep_scales"][c]  # bags: each id reads its bag's gradient times its weight there
            with self._beside(packed, rep_ids, *([scales] if scales is not None else [])):  # beside the bottom MLP
                rep_grad = packed[n_send:].view(b, len(lay.rep), dim)
                step["rep_acc"] = replicated_grad(rep_ids, self.rep_offsets(), rep_grad,
                                                  rep.weight.shape[0], self.cache, counts=needs_counts(rep),
                                                  out=step["rep_acc"], presorted=step["rep_sorted"][c],
                                                  bags=None if scales is None else (self.rep_bag_slot_table, scales))
                if last and self.world_size > 1:
                    # on the default group's communicator: beside the all-to-all, not behind it
                    whole = self.world_size == dist.get_world_size()
                    step["rep_work"] = dist.all_reduce(step["rep_acc"], group=None if whole else self.group,
                                                       async_op=True)
        step["arrived"] += 1
        if not last:
            return  # the last chunk's backward queues the update
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
            # after the whole backward: the update started as soon as its exchange landed, beside the
            # bottom MLP's backward, was measured slower on 4 H200s (benchmarks/NOTES.md)
            pools = [t for p in step["pools"] if p is not None for t in (p.index, p.div)]
            read = [step["rows"], step["grad"], *pools, *step["bag_ids"], *step["scales"]]
            with self._beside(*(read if step["grad"] is not None else [])):
                self._apply_update(step)
        self._join_side()
        if self.ahead is not None:  # after the update: its rows buffer is the one written here
            (r, work), self.ahead = self.ahead, None
            if r.rows.is_cuda:  # made on the side stream, read below on this one
                r.rows.record_stream(torch.cuda.current_stream())
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
        local = self.local
        if self.model_parallel and step["rows"].numel() and step["scales"]:  # `layout.owner_bags`
            ids = step["bag_ids"][0] if step["chunks"] == 1 else torch.cat(step["bag_ids"])
            scales = step["scales"][0] if step["chunks"] == 1 else torch.cat(step["scales"])
            grad = step["grad"].view(ids.shape[0], len(self.layout.tab[self.rank]), self.embedding_dim)
            bags.update_bags(ids, self.bag_layout("owner"), grad, scales, local.weight, local.row_state, local.scratch,
                             local.pre_reduce, grad_scale=1.0 / self.world_size, presorted=step["sorted"])
        elif self.model_parallel and step["rows"].numel():
            ops.update_rows(step["rows"].view(-1, 1), self.zero_offset,
                            self._id_grads(step).view(-1, 1, self.embedding_dim), local.weight, local.row_state,
                            local.scratch, local.pre_reduce, grad_scale=1.0 / self.world_size,
                            presorted=step["sorted"])
        elif local is not None and local.row_state.optimizer == "adam":
            local.row_state.hyper[1].add_(1.0)  # no id came: Adam's step count still advances, as everywhere
        if step["rep_work"] is not None:
            step["rep_work"].wait()
        if step["rep_acc"] is not None:
            apply_replicated(step["rep_acc"], self.replica, self.world_size)

    def _id_grads(self, step: dict) -> torch.Tensor:
        """The step's gradient of every id it received: the returned vectors' gradients, spread over
        their bags' ids chunk by chunk where this rank pooled (as they are otherwise)."""
        grad = step["grad"]
        pools = step["pools"]
        if all(p is None for p in pools):
            return grad
        bounds = step["back"]
        parts = [grad[bounds[c]:bounds[c + 1]] if p is None else p.spread(grad[bounds[c]:bounds[c + 1]])
                 for c, p in enumerate(pools)]
        return parts[0] if len(parts) == 1 else torch.cat([p.float() for p in parts])
