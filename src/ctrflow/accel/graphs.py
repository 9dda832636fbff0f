"""The whole training step as one CUDA graph (`ctrflow train` on one CUDA GPU or under torchrun), and
the dense head compiled (one GPU).

A DCNv2 or DLRM step launches a few hundred kernels; launched one by one from Python they leave the
GPU idle between them. `GraphedStep` runs the loop's own step function eagerly for `warmup` steps
(real steps: kernels compile, optimizer state is made), captures the next one and from then on
copies each batch into the graph's static input tensors and replays it. The replay runs the same
kernels on the same memory as the captured eager step; against eager training the losses differ
only by the fused tables' atomic-add order and capturable Adam's device-side arithmetic (at most
1.6e-5 over 20 DCNv2 steps on an H200).

What makes a step capturable: every table fused (its optimizer step runs inside backward with no
host sync; sparse gradients have data-dependent shapes and cannot be captured), a dense Adam/AdamW
(made `capturable`, its learning rate a device tensor that the schedule's value is copied into
before each step), batches of one shape (the train loader drops the last partial one). Under
torchrun the tables are `FusedShardedEmbeddingCollection`s with static all-to-alls (no row-wise
table: no host sync) and the dense part is not under DDP: the step averages its gradients itself
(`DenseAverage`: one all-reduce started before the tables' update), so the graph holds NCCL calls
(the eager collectives of validation and checkpoints run between replays); it is captured with
`capture_error_mode="thread_local"` (NCCL's watchdog thread keeps running) and must be released
(`GraphedStep.release`) before the process group is destroyed. `use_graphs` checks this;
otherwise the loop keeps its eager step (`ctrflow.accel.plan.plan_run` decides).

Fused tables in host memory (one process) are graphed too: their lookup of a batch waits for its
prefetch and reads sizes back, so it runs before each replay (`FusedEmbeddingCollection.stage`) and
the graph reads its result; the capture waits until the prefetching threads are idle, and runs in
thread-local mode all the same (their CUDA calls never invalidate it). Eager launches of the step's
few hundred kernels would otherwise compete with those threads for the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ctrflow.config import TrainConfig
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.loaders.batch import Batch

if TYPE_CHECKING:
    from ctrflow.runtime import Runtime

CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW)  # optimizers whose learning rate may be a device tensor
CAPTURABLE_DENSE = ("adam", "adamw")  # their `--dense-optimizer` names


class StepOptimizers(Protocol):
    """What the graphed step reads of a run's optimizers (`ctrflow.train.optim.Optimizers`)."""

    dense: torch.optim.Optimizer
    sparse: torch.optim.Optimizer | None


StepFn = Callable[[nn.Module, Batch, StepOptimizers, torch.device, "torch.dtype | None"], torch.Tensor]


def use_graphs(config: TrainConfig, runtime: Runtime, all_fused: bool, static_exchange: bool = True) -> bool:
    """`--cuda-graphs auto`: on when the step is capturable (module doc): on CUDA, every table fused
    (`all_fused`), a dense Adam/AdamW and, sharded, no row-wise table (`static_exchange`: the
    all-to-all sizes would depend on the ids, a host read per step); `off` never."""
    if config.cuda_graphs == "off":
        return False
    return (runtime.device.type == "cuda" and all_fused and config.optim.dense in CAPTURABLE_DENSE
            and static_exchange)


class GraphedStep:
    """Callable like the loop's step function (`step(model, batch, optimizers, device, amp) -> loss`,
    plus `next_ids`: the next step's ids, handed on where given), capturing it as a CUDA graph after
    `warmup` eager steps (module doc). `host`: the fused collection with tables in host memory, whose
    lookups run before each replay. Call `release()` before destroying the process group."""

    def __init__(self, step: StepFn, warmup: int = 3, host: FusedEmbeddingCollection | None = None):
        self.step, self.warmup, self.calls, self.host = step, warmup, 0, host
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Batch | None = None
        self.next_ids: torch.Tensor | None = None  # the graph's copy of the next step's ids
        self.loss: torch.Tensor | None = None
        self.lrs: list[torch.Tensor | float] = []

    def __call__(self, model: nn.Module, batch: Batch, optimizers: StepOptimizers, device: torch.device,
                 amp: torch.dtype | None = None, next_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._set_lrs(optimizers, device)
        self.calls += 1
        ahead = {} if next_ids is None else {"next_ids": next_ids}
        if self.graph is not None:
            self._copy_in(batch, next_ids)
            if self.host is not None:
                self.host.stage(batch.sparse)
            self.graph.replay()
            if hasattr(optimizers.sparse, "steps"):  # host-side count its (empty) step() keeps: checkpoints carry it
                optimizers.sparse.steps += 1
            return self.loss
        default, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        if self.host is not None and self.calls > self.warmup:
            self.host.stage(batch.sparse, settle=True)  # on the default stream; the prefetches then rest
        side.wait_stream(default)  # warm-up and capture off the default stream, as torch asks
        with torch.cuda.stream(side):  # noqa: SIM117 (the capture needs the side stream current)
            if self.calls <= self.warmup:
                loss = self.step(model, batch, optimizers, device, amp, **ahead)
                loss.record_stream(default)  # made on the side stream, read on the default one next
            else:
                self._capture(model, batch, optimizers, device, amp, ahead, side)
        default.wait_stream(side)
        if self.graph is None:
            return loss
        self.graph.replay()  # capture ran no kernel: this is the step's work
        return self.loss

    def _capture(self, model, batch, optimizers, device, amp, ahead: dict, side: torch.cuda.Stream) -> None:
        # copies: the graph's inputs must not alias the loader's tensors
        self.static = Batch(*(t.to(device, non_blocking=True).clone()
                              for t in (batch.dense, batch.sparse, batch.labels)))
        if ahead:
            self.next_ids = ahead["next_ids"].to(device, non_blocking=True).clone()
            ahead = {"next_ids": self.next_ids}
        # several processes: NCCL's watchdog thread queries events during the capture
        several = dist.is_initialized() and dist.get_world_size() > 1
        mode = "thread_local" if several or self.host is not None else "global"
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode=mode):
            self.loss = self.step(model, self.static, optimizers, device, amp, **ahead)

    def release(self) -> None:
        """Free the graph and its memory (then the step captures again on its next calls). Needed
        before `destroy_process_group` when the graph holds NCCL calls: NCCL waits for such graphs."""
        if self.graph is not None and self.loss is not None:  # (a capture that raised left no graph to free)
            torch.cuda.synchronize()  # the last replay has finished
            self.graph.reset()
        self.graph = self.static = self.next_ids = self.loss = None
        self.calls = 0

    def _copy_in(self, batch: Batch, next_ids: torch.Tensor | None) -> None:
        """The batch into the graph's input tensors (same shapes: full batches only)."""
        pairs = [(self.static.dense, batch.dense), (self.static.sparse, batch.sparse),
                 (self.static.labels, batch.labels)]
        if (next_ids is None) != (self.next_ids is None):
            raise ValueError("a CUDA-graphed step captured with(out) next_ids is called without (with) them")
        if next_ids is not None:
            pairs.append((self.next_ids, next_ids))
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"a CUDA-graphed step needs batches of one shape: {tuple(src.shape)} "
                                 f"!= {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)

    def _set_lrs(self, optimizers: StepOptimizers, device: torch.device) -> None:
        """The schedule's learning rates (floats the loop writes) into device tensors that the
        captured optimizer step reads; dense optimizer made capturable before its first step.
        Other optimizers (SGD: its step reads a float learning rate on the host) keep the value
        they were captured with: changing it afterwards raises."""
        groups = optimizers.dense.param_groups
        if type(optimizers.dense) not in CAPTURABLE:
            if not self.lrs:
                self.lrs = [float(g["lr"]) for g in groups]
            elif self.graph is not None and [float(g["lr"]) for g in groups] != self.lrs:
                raise ValueError(f"{type(optimizers.dense).__name__} in a CUDA graph: its learning rate is fixed "
                                 "at capture (use Adam/AdamW for a schedule)")
            elif self.graph is None:
                self.lrs = [float(g["lr"]) for g in groups]
            return
        if not self.lrs:
            self.lrs = [torch.tensor(float(g["lr"]), device=device) for g in groups]
            for g in groups:
                g["capturable"] = True
            for state in optimizers.dense.state.values():  # resumed from an eager run: steps on the host
                if "step" in state and state["step"].device != device:
                    state["step"] = state["step"].to(device, torch.float32)
        for group, lr in zip(groups, self.lrs):
            if not isinstance(group["lr"], torch.Tensor):
                lr.fill_(group["lr"])  # a kernel with the value as argument: no sync
            group["lr"] = lr
