"""One code path for 1 and N processes: rank/world read once, `print0`, collectives on host values.

Under `torchrun` the environment has RANK, WORLD_SIZE and LOCAL_RANK; alone it has none and
this is process 0 of 1, with no process group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ctrflow.errors import UserError


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank among `world_size` and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is up."""
        return self.world_size > 1


def init_runtime(device: str = "auto") -> Runtime:
    """Read RANK/WORLD_SIZE/LOCAL_RANK once, pick the device, start the process group if N > 1."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA GPU is visible to torch")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise UserError(f"--device must be auto, cpu or cuda, got {device!r}")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Runtime(rank, world, local, dev)


def close_runtime(runtime: Runtime) -> None:
    """Tear the process group down (no-op for one process). CUDA graphs that captured NCCL calls
    must be released first (`GraphedStep.release`): NCCL's communicator teardown waits for every
    graph holding one of its operations, and hangs here while a graph is alive (seen on H200s). The
    device is synchronized so no kernel still uses a communicator."""
    if runtime.distributed and dist.is_initialized():
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        dist.destroy_process_group()


def print0(*args, **kwargs) -> None:
    """`print` on rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def barrier(runtime: Runtime) -> None:
    """Wait for every process (a sync point; no-op alone)."""
    if runtime.distributed:
        dist.barrier()


def all_reduce_sum(value: float, runtime: Runtime) -> float:
    """Sum a host scalar over processes."""
    if not runtime.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(t)
    return float(t.item())


def gather_arrays(array: np.ndarray, runtime: Runtime) -> np.ndarray:
    """Concatenate every process's array in rank order (all processes receive it)."""
    if not runtime.distributed:
        return array
    parts: list = [None] * runtime.world_size
    dist.all_gather_object(parts, array)
    return np.concatenate(parts)
