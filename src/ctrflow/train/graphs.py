"""The whole training step as one CUDA graph, and the dense head compiled (`ctrflow train`, one CUDA GPU).

A DCNv2 or DLRM step launches a few hundred kernels; launched one by one from Python they leave the
GPU idle between them. `GraphedStep` runs the loop's own step function eagerly for `warmup` steps
(real steps: kernels compile, optimizer state is made), captures the next one and from then on
copies each batch into the graph's static input tensors and replays it. The replay runs the same
kernels on the same memory as the captured eager step; against eager training the losses differ
only by the fused tables' atomic-add order and capturable Adam's device-side arithmetic (at most
1.6e-5 over 20 DCNv2 steps on an H200).

What makes a step capturable: every table fused (its optimizer step runs inside backward with no
host sync; sparse gradients have data-dependent shapes and cannot be captured), one process, a
dense Adam/AdamW (made `capturable`, its learning rate a device tensor that the schedule's value is
copied into before each step), batches of one shape (the train loader drops the last partial one).
`use_graphs` checks this; otherwise the loop keeps its eager step.

`compile_dense` torch.compiles what follows the lookup (`model.head` where the model has one: one
inductor graph for DCNv2's concatenation, cross layers and deep MLP).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ctrflow.config import TrainConfig
from ctrflow.data.batch import Batch
from ctrflow.train.distributed import Runtime
from ctrflow.train.optim import Optimizers

StepFn = Callable[[nn.Module, Batch, Optimizers, torch.device, "torch.dtype | None"], torch.Tensor]


def use_graphs(config: TrainConfig, runtime: Runtime, optimizers: Optimizers) -> bool:
    """`--cuda-graphs auto`: on when the step is capturable (module doc); `off` never."""
    if config.cuda_graphs == "off":
        return False
    return (runtime.device.type == "cuda" and not runtime.distributed and optimizers.fused is not None
            and not optimizers.sparse_names and type(optimizers.dense) in (torch.optim.Adam, torch.optim.AdamW))


def use_compile(config: TrainConfig, runtime: Runtime) -> bool:
    """`--compile auto`: torch.compile the dense head on CUDA; `off` never (the CPU never: slow to build)."""
    return config.compile != "off" and runtime.device.type == "cuda"


def compile_dense(model: nn.Module, mode: str | None = None) -> bool:
    """Compile, in place, `model.head` (everything after the lookup) where the model has one
    (DCNv2); returns whether it did. Parameters and state-dict keys stay as they were. Models
    without a head (DLRM: its fused interaction is already one kernel) keep their eager dense parts:
    compiling them apart was not measured through the loop."""
    if not callable(getattr(type(model), "head", None)):
        return False
    model.head = torch.compile(model.head, mode=mode)  # instance attribute: forward finds it
    return True


class GraphedStep:
    """Callable like the loop's step function (`step(model, batch, optimizers, device, amp) -> loss`),
    capturing it as a CUDA graph after `warmup` eager steps (module doc)."""

    def __init__(self, step: StepFn, warmup: int = 3):
        self.step, self.warmup, self.calls = step, warmup, 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Batch | None = None
        self.loss: torch.Tensor | None = None
        self.lrs: list[torch.Tensor] = []

    def __call__(self, model: nn.Module, batch: Batch, optimizers: Optimizers, device: torch.device,
                 amp: torch.dtype | None = None) -> torch.Tensor:
        self._set_lrs(optimizers, device)
        self.calls += 1
        if self.graph is not None:
            self._copy_in(batch)
            self.graph.replay()
            if hasattr(optimizers.sparse, "steps"):  # host-side count its (empty) step() keeps: checkpoints carry it
                optimizers.sparse.steps += 1
            return self.loss
        default, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        side.wait_stream(default)  # warm-up and capture off the default stream, as torch asks
        with torch.cuda.stream(side):  # noqa: SIM117 (the capture needs the side stream current)
            if self.calls <= self.warmup:
                loss = self.step(model, batch, optimizers, device, amp)
                loss.record_stream(default)  # made on the side stream, read on the default one next
            else:
                # copies: the graph's inputs must not alias the loader's tensors
                self.static = Batch(*(t.to(device, non_blocking=True).clone()
                                      for t in (batch.dense, batch.sparse, batch.labels)))
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=side):
                    self.loss = self.step(model, self.static, optimizers, device, amp)
        default.wait_stream(side)
        if self.graph is None:
            return loss
        self.graph.replay()  # capture ran no kernel: this is the step's work
        return self.loss

    def _copy_in(self, batch: Batch) -> None:
        """The batch into the graph's input tensors (same shapes: full batches only)."""
        for dst, src in ((self.static.dense, batch.dense), (self.static.sparse, batch.sparse),
                         (self.static.labels, batch.labels)):
            if dst.shape != src.shape:
                raise ValueError(f"a CUDA-graphed step needs batches of one shape: {tuple(src.shape)} "
                                 f"!= {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)

    def _set_lrs(self, optimizers: Optimizers, device: torch.device) -> None:
        """The schedule's learning rates (floats the loop writes) into device tensors that the
        captured optimizer step reads; dense optimizer made capturable before its first step."""
        groups = optimizers.dense.param_groups
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
