"""The dense gradients averaged over processes by the step itself, instead of DDP (N processes,
fused sharded tables).

DDP all-reduces gradient buckets from hooks during backward; its hooks and host-side bookkeeping
cannot be captured in a CUDA graph. `DenseAverage` does the same arithmetic as one all-reduce of the
concatenated dense gradients after backward, started BEFORE the fused sharded tables' deferred
update (`update_in_backward = False`, then `flush()`), so the all-reduce runs beside that update.
The whole step then has no host sync and `GraphedStep` captures it (`ctrflow.train.graphs`); eager
steps use the same code (`tests/unit/test_dense_average.py` holds it equal to DDP's step).
On 4 H200s (`benchmarks/sharded_scale.py --graph`, benchmarks/NOTES.md) a communicator of its own
("own") was faster than the default one, where the all-reduce queued behind the replicated tables'.
Starting part of it from gradient hooks during backward failed under capture (NOTES, session 3 A2),
so `early` (DLRM's top MLP: 2.3 M of its 2.5 M dense parameters) splits the backward in two on the
calling thread instead: from the loss to the module's input, the all-reduce of that module's
gradients started, then on to the tables and the bottom MLP; the same operations, so the same
gradients, and the all-reduce runs under the interaction's backward instead of after the whole pass.
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

    def __init__(self, params: Iterable[nn.Parameter], tables: Iterable[nn.Module] = (), comm: str = "own",
                 early: nn.Module | None = None):
        if comm not in ("own", "shared"):
            raise ValueError(f"comm must be own or shared, got {comm!r}")
        self.params = [p for p in params if p.requires_grad]
        self.tables = list(tables)
        self.world = dist.get_world_size()
        self.group = dist.new_group(list(range(self.world))) if comm == "own" else None
        mine = {id(p) for p in self.params}
        # [early module's parameters, the rest]: all-reduced apart, the first during backward
        first = [p for p in early.parameters() if id(p) in mine] if early is not None else []
        taken = {id(p) for p in first}
        self.buckets = [b for b in (first, [p for p in self.params if id(p) not in taken]) if b]
        self.works: list = []
        self.flats: list[torch.Tensor] = []
        # the early module's input in the last forward with grad, and the detached leaf it ran on instead
        self.cut: tuple[torch.Tensor, torch.Tensor] | None = None
        if first:
            early.register_forward_pre_hook(self._cut_input)
        for coll in self.tables:
            coll.update_in_backward = False  # `reduce` flushes it, after starting the all-reduce
        self._broadcast_values()

    @torch.compiler.disable  # runs as Python even inside a compiled module's call
    def _cut_input(self, module: nn.Module, args: tuple) -> tuple | None:
        """The module runs on a leaf copy of its input, so the loss's backward stops there."""
        self.cut = None
        if not (torch.is_grad_enabled() and args[0].requires_grad):
            return None
        leaf = args[0].detach().requires_grad_()
        self.cut = (args[0], leaf)
        return (leaf, *args[1:])

    @torch.no_grad()
    def _broadcast_values(self) -> None:
        """Rank 0's values everywhere (one flat broadcast)."""
        if not self.params:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        dist.broadcast(flat, 0, group=self.group)
        torch._foreach_copy_([p.data for p in self.params], _views(flat, self.params))

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, then the average: with an `early` module, backward to its input first,
        that module's all-reduce started, then the rest of backward; then `reduce()`."""
        cut, self.cut = self.cut, None
        loss.backward()  # with a cut: down to the early module's input
        if cut is not None:
            self._start(self.buckets[0])
            cut[0].backward(cut[1].grad)  # the rest, from the input's gradient on
        self.reduce()

    def _start(self, params: list[nn.Parameter]) -> None:
        """Start the all-reduce of these parameters' gradients, concatenated (asynchronous)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self.flats.append(torch.cat([g.reshape(-1) for g in grads]))  # [sum of numels]
        self.works.append(dist.all_reduce(self.flats[-1], group=self.group, async_op=True))

    def start(self) -> None:
        """Start the all-reduce of the gradients not started yet (asynchronous)."""
        for params in self.buckets[len(self.flats):]:
            self._start(params)

    def finish(self) -> None:
        """Wait for the all-reduces and write the averages into the parameters' `.grad`."""
        for params, flat, work in zip(self.buckets, self.flats, self.works):
            work.wait()
            flat.div_(self.world)
            for p in params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
            torch._foreach_copy_([p.grad for p in params], _views(flat, params))
        self.works, self.flats = [], []

    def reduce(self) -> None:
        """After backward: start the all-reduce, apply the tables' update beside it, then wait."""
        self.start()
        for coll in self.tables:
            coll.flush()
        self.finish()


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into tensors shaped like `like`'s, in order."""
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like)]
