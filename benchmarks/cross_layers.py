"""DCNv2's cross layers alone on one GPU: the compiled plain `LowRankCrossNet` against `FusedCrossNet`,
and each fused kernel against the cuBLAS product it replaces.

    PYTHONPATH=src python3 benchmarks/cross_layers.py [--rows 65536 --width 3456 --rank 512 --layers 3]

Forward + backward of the cross layers under bf16 autocast (median of 20 after 5 warm-up), then one
line per kernel mode (ms per launch): `forward` (z U^T + b, x0 * h + x; layer 0 has x = x0),
`first` (no product: dh = G * x0, bias sums, acc = G * h), `middle` (dz V + G, then the same),
`last` (dz V + G + acc), and the cuBLAS products they fold in. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F

from ctrflow.embedding.fused.cross import FusedCrossNet, cross_backward, cross_forward
from ctrflow.models.layers import LowRankCrossNet


def time_ms(fn, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of `fn()` on the GPU (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def time_cross(cross, x0: torch.Tensor, grad: torch.Tensor) -> float:
    """Forward + backward of `cross` on x0, ms."""
    x = x0.detach().requires_grad_()

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            y = cross(x)
        y.backward(grad)

    return time_ms(step)


def time_kernels(rows: int, width: int, rank: int) -> dict:
    """Each fused kernel mode and the cuBLAS products it replaces, ms per launch."""
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x0, x, h, g, acc = (t(rows, width) for _ in range(5))
    z, dz, up, down = t(rows, rank), t(rows, rank), t(width, rank), t(rank, width)
    bias = torch.randn(width, device="cuda")
    return {
        "forward": time_ms(lambda: cross_forward(z, up, bias, x0, x)),
        "first": time_ms(lambda: cross_backward(None, None, g, x0, h, None, last=False)),
        "middle": time_ms(lambda: cross_backward(dz, down, g, x0, h, acc, last=False)),
        "last": time_ms(lambda: cross_backward(dz, down, g, x0, None, acc, last=True)),
        "cublas_up_bias": time_ms(lambda: F.linear(z, up, bias.bfloat16())),
        "cublas_dgrad_add": time_ms(lambda: torch.addmm(g, dz, down)),
        "copy_one_pass": time_ms(lambda: x.copy_(x0)) / 2,  # a read + a write: two passes
    }


def main(argv=None) -> dict:
    """Time the plain compiled, plain eager and fused cross layers; print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--width", type=int, default=3456)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    args = p.parse_args(argv)
    plain = LowRankCrossNet(args.width, args.layers, args.rank).cuda()
    fused = FusedCrossNet.from_plain(copy.deepcopy(plain))
    x0 = torch.randn(args.rows, args.width, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x0)
    result = {"rows": args.rows, "width": args.width, "rank": args.rank, "layers": args.layers,
              "plain_compiled_ms": time_cross(torch.compile(plain), x0, grad),
              "fused_ms": time_cross(fused, x0, grad),
              "kernels_ms": time_kernels(args.rows, args.width, args.rank)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
