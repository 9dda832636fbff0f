"""Median CUDA-event time of a GPU call, for the kernel-level benchmark scripts (one H200)."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, reps: int = 20) -> float:
    """Median milliseconds of `fn()` over `reps` CUDA-event timings, after 3 warm-up calls (kernels
    compiled, caches and clocks settled)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
