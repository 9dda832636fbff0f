"""Side streams: GPU work queued beside the current stream's, where nothing that follows waits for it
until an explicit join (the fused sharded tables' own work, the fp8 cross layers' weight gradients)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

_STREAMS: dict = {}


def side_stream(device: torch.device, owner: str) -> torch.cuda.Stream | None:
    """`owner`'s side stream on a CUDA device, made once (None elsewhere: the work stays in line)."""
    if device.type != "cuda":
        return None
    if (device, owner) not in _STREAMS:
        _STREAMS[device, owner] = torch.cuda.Stream(device)
    return _STREAMS[device, owner]


@contextmanager
def beside(side: torch.cuda.Stream | None, *inputs: torch.Tensor):
    """Run the block on `side` (None: on the current stream), after what the current stream queued so
    far; `inputs`, made on the current stream, are not reused before the side stream has read them.
    The caller joins (`torch.cuda.current_stream().wait_stream(side)`) before it reads the results."""
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream())
    for t in inputs:
        t.record_stream(side)
    with torch.cuda.stream(side):
        yield
