"""FP8 against bf16 matrix products at DCNv2's shapes (batch 65,536), one GPU.

    PYTHONPATH=src python3 benchmarks/fp8_gemm.py

For each (K, N) of the cross layers and the deep MLP's first layers: TFLOP/s of the bf16 product
(x [M, K] @ W^T), of `torch._scaled_mm` with row scales and with one scale per tensor (fp32
accumulation; fast accumulation too), `ctrflow.accel.fp8.product`'s Triton kernel where it applies
(K <= 512, fast accumulation; with its ratio to cuBLAS's), and the eager cost of quantizing x. Prints one
JSON line.
"""

from __future__ import annotations

import json

import torch

from ctrflow.accel.fp8 import product as fp8_product
from ctrflow.accel.fp8.linear import E4M3, quantize_rows, quantize_tensor

SHAPES = [(3456, 512), (512, 3456), (3456, 1024), (1024, 1024), (1024, 512)]


def time_ms(fn, reps: int = 20) -> float:
    """Median-free mean over `reps` launches after 3 warm-ups (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def measure_shape(m: int, k: int, n: int) -> dict:
    """TFLOP/s of each variant for x [m, k] @ w [n, k]^T."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xr, sxr = quantize_rows(x, E4M3)
    wr, swr = quantize_rows(w, E4M3)
    xt, sxt = quantize_tensor(x, E4M3)
    wt, swt = quantize_tensor(w, E4M3)
    flop = 2 * m * k * n
    variants = {
        "bf16": lambda: x @ w.t(),
        "fp8_row": lambda: torch._scaled_mm(xr, wr.t(), scale_a=sxr, scale_b=swr.t(), out_dtype=torch.bfloat16),
        "fp8_row_fast": lambda: torch._scaled_mm(xr, wr.t(), scale_a=sxr, scale_b=swr.t(),
                                                 out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8_tensor": lambda: torch._scaled_mm(xt, wt.t(), scale_a=sxt, scale_b=swt, out_dtype=torch.bfloat16),
        "fp8_tensor_fast": lambda: torch._scaled_mm(xt, wt.t(), scale_a=sxt, scale_b=swt,
                                                    out_dtype=torch.bfloat16, use_fast_accum=True),
    }
    if fp8_product.suits(xr, wr, fast=True):
        variants["fp8_row_triton"] = lambda: fp8_product.scaled_product(xr, sxr, wr, swr)
    out = {f"{name}_tflops": round(flop / time_ms(fn) / 1e9, 1) for name, fn in variants.items()}
    if "fp8_row_triton_tflops" in out:
        out["triton_over_cublas"] = round(out["fp8_row_triton_tflops"] / out["fp8_row_fast_tflops"], 3)
    out["quantize_rows_ms"] = round(time_ms(lambda: quantize_rows(x, E4M3)), 3)
    return out


def main() -> dict:
    """Every shape; print and return the table as one JSON-able dict."""
    m = 65536
    result = {"device": torch.cuda.get_device_name(), "m": m}
    for k, n in SHAPES:
        result[f"k{k}_n{n}"] = measure_shape(m, k, n)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
