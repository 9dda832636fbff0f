"""The fp8 cross layers alone on one GPU (DCNv2 MLPerf shape: M 65,536, N 3456, rank 512, 3 layers).

    PYTHONPATH=src python3 benchmarks/fp8_cross.py [--sweep]

1. Each row kernel of `ctrflow.accel.fp8.cross` (and `fp8_wgrad`'s dh pass) against its bytes (P = one
   bf16 pass over [M, N]), with torch's device copy (2 P) as the bandwidth reference; `--sweep` also
   times other launch shapes.
2. The cross net's forward + backward: `Fp8CrossNet` against the same `Fp8Linear` layers compiled by
   inductor (the path before it) and the plain bf16 layers compiled.
Prints one JSON line (times in ms, median of CUDA-event timed runs).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from ctrflow.models.layers import LowRankCrossNet
from ctrflow.accel.fp8 import cross as C
from ctrflow.accel.fp8 import wgrad as W
from ctrflow.accel.fp8.apply import apply_fp8
from ctrflow.accel.fp8.linear import E4M3, E5M2
from cuda_timing import median_ms

SHAPES = [(4096, 4), (8192, 8), (8192, 16)]  # (tile, warps): LAUNCH settings tried by --sweep


def kernel_times(m: int, n: int, layers: int) -> dict:
    """ms and GB/s of each row kernel at [m, n] (module doc, 1)."""
    t = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(4 + 2 * layers)]
    x0, h, x, g = t[:4]
    ds, hs = t[4:4 + layers], t[4 + layers:]  # distinct tensors: a row read twice would hit the cache
    z = x0[:, :512].contiguous()  # a rank-512 activation
    fold = C.quantize(z, E4M3)[1]  # z's row scales, folded into dh's batch-major copy
    bound = W.dh_bounds([W.row_amax(g)], W.row_amax(x0))
    bytes_p = m * n * 2
    cases = {
        "copy": (lambda: x.copy_(h), 2.0),
        "quantize_x0": (lambda: C.quantize(x0, E4M3), 1.5),
        "forward_first": (lambda: C.cross_forward(x0, h, x0, True), 3.5),
        "forward_middle": (lambda: C.cross_forward(x0, h, x, True), 4.5),
        "forward_last": (lambda: C.cross_forward(x0, h, x, False), 4.0),
        "dh_top": (lambda: W.cross_dh_tiles(g, [], x0, E5M2, bound, fold), 3.0),
        "dh_bottom": (lambda: W.cross_dh_tiles(g, ds[1:], x0, E5M2, bound, fold), 3.0 + layers - 1),
        "dx0": (lambda: C.cross_dx0(g, ds, hs), 2.0 * layers + 2),
        "quantize_z": (lambda: C.quantize(z, E4M3), 1.5 * 512 / n),
    }
    out = {}
    for name, (fn, passes) in cases.items():
        ms = median_ms(fn)
        out[name] = {"ms": round(ms, 4), "passes": passes, "GB_s": round(passes * bytes_p / ms / 1e6)}
    return out


def net_times(m: int, n: int, rank: int, layers: int) -> dict:
    """ms of the cross net's forward + backward in three versions (module doc, 2)."""
    torch.manual_seed(0)
    plain = LowRankCrossNet(n, layers, rank).cuda()
    own, fused = torch.nn.Sequential(copy.deepcopy(plain)), torch.nn.Sequential(copy.deepcopy(plain))
    apply_fp8(own, fuse_cross=False)
    apply_fp8(fused)
    x0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, net in (("bf16_compiled", torch.compile(plain)), ("fp8_linear_compiled", torch.compile(own)),
                      ("fp8_cross_kernels", fused)):
        def step(net=net):
            with torch.autocast("cuda", torch.bfloat16):
                y = net(x0)
            y.backward(grad)
        out[name] = round(median_ms(step, reps=10), 3)
    return out


def main() -> None:
    """Run both parts at the MLPerf shape; print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--width", type=int, default=3456)
    p.add_argument("--rank", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    result = {"device": torch.cuda.get_device_name(), "launch": dict(C.LAUNCH),
              "kernels": kernel_times(args.rows, args.width, args.layers)}
    if args.sweep:
        default = dict(C.LAUNCH)
        for tile, warps in SHAPES:
            C.LAUNCH.update(tile=tile, warps=warps)
            times = kernel_times(args.rows, args.width, args.layers)
            result[f"tile{tile}_w{warps}"] = {k: v["ms"] for k, v in times.items()}
        C.LAUNCH.update(default)
    result["net_fwd_bwd_ms"] = net_times(args.rows, args.width, args.rank, args.layers)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
