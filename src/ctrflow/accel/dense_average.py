"""The dense gradients averaged over processes by the step itself, instead of DDP (N processes,
fused sharded tables).

DDP all-reduces gradient buckets from hooks during backward; its hooks and host-side bookkeeping
cannot be captured in a CUDA graph. `DenseAverage` does the same arithmetic as one all-reduce of the
concatenated dense gradients after backward, started BEFORE the fused sharded tables' deferred
update (`update_in_backward = False`, then `flush()`), so the all-reduce runs beside that update.
The whole step then has no host sync and `GraphedStep` captures it (`ctrflow.accel.graphs`); eager
steps use the same code (`tests/integration/steps/test_dense_average.py` holds it equal to DDP's step).
On 4 H200s (`benchmarks/sharded_scale.py --graph`, benchmarks/NOTES.md) a communicator of its own
("own") was faster than the default one, where the all-reduce queued behind the replicated tables'.
Starting part of it from gradient hooks during backward failed under CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


class DenseAverage:
    """Averages `params`' gradients over every process (a collective: all ranks build it in the same
    order and call `reduce` every step). `tables`: fused sharded collections whose update this step
    flushes while the all-reduce runs; `comm` "own" (a new communicator) or "shared" (the default).
    Building it copies rank 0's parameter values to every rank, as DDP does."""

    def __init__(self, params: Iterable[nn.Parameter], tables: Iterable[nn.Module] = (), comm: str = "own"):
        if comm not in ("own", "shared"):
            raise ValueError(f"comm must be own or shared, got {comm!r}")
        self.params = [p for p in params if p.requires_grad]
        self.tables = list(tables)
        self.world = dist.get_world_size()
        self.group = dist.new_group(list(range(self.world))) if comm == "own" else None
        self.work = None
        self.flat: torch.Tensor | None = None
        for coll in self.tables:
            coll.update_in_backward = False  # `reduce` flushes it, after starting the all-reduce
        self._broadcast_values()

    @torch.no_grad()
    def _broadcast_values(self) -> None:
        """Rank 0's values everywhere (one flat broadcast)."""
        if not self.params:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        dist.broadcast(flat, 0, group=self.group)
        torch._foreach_copy_([p.data for p in self.params], _views(flat, self.params))

    def start(self) -> None:
        """Start the all-reduce of the gradients' concatenation (asynchronous)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.flat = torch.cat([g.reshape(-1) for g in grads])  # [sum of numels]
        self.work = dist.all_reduce(self.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for the all-reduce and write the averages into the parameters' `.grad`."""
        self.work.wait()
        self.flat.div_(self.world)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.empty_like(p)
        torch._foreach_copy_([p.grad for p in self.params], _views(self.flat, self.params))
        self.work, self.flat = None, None

    def reduce(self) -> None:
        """After backward: start the all-reduce, apply the tables' update beside it, then wait."""
        self.start()
        for coll in self.tables:
            coll.flush()
        self.finish()


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into tensors shaped like `like`'s, in order."""
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like)]
