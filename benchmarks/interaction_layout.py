"""Why DLRM's fused interaction is slower reading the 4-GPU exchange buffer in place (one GPU).

    PYTHONPATH=src python3 benchmarks/interaction_layout.py [--batch 65536] [--dim 128] [--sweep]

Times `FusedDotInteraction`'s forward and backward kernels (bf16, 27 features) on one GPU for
embeddings laid out as: `plain` [B, 26, D] (the unmapped kernels); `identity`, the same buffer read
through the MAPPED path (its row map says [B, 26, D]); `exchange`, the layout 4 ranks' exchange
leaves (four blocks of B x 2 rows 32 MiB apart, then B x 18 replicated rows: the MLPerf plan of
`sharded_scale.py`); `exchange-gaps`, that with the blocks moved off their power-of-two spacing.
Prints one JSON line: microseconds per call (median of CUDA-event timings) and each compiled
kernel's registers per thread and spilled bytes (registers bound how many programs share an SM:
an earlier MAPPED forward held 181 against the plain one's 152, so 2 programs per SM instead of 3;
`NOTES.md`).
`--sweep`: also `plain` and `exchange` under each warps x samples-per-program pair, one line each.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from ctrflow.accel import interaction as fi
from cuda_timing import median_ms

# sharded_scale's 4-GPU plan: rank -> the (0-based) features it holds whole; the other 18 replicated
RANKS = {0: [11, 19], 1: [0, 22], 2: [10, 21], 3: [9, 20]}


def exchange_rows(gap: int) -> torch.Tensor:
    """[3, 26] the exchange layout's row map (batch scale, sample stride, first row), blocks `gap`
    rows further apart each."""
    rows = torch.zeros(3, 26, dtype=torch.int64)
    rep = [f for f in range(26) if all(f not in v for v in RANKS.values())]
    start = 0
    for i, group in enumerate([*RANKS.values(), rep]):
        for k, f in enumerate(group):
            rows[:, f] = torch.tensor([start, len(group), k + i * gap])
        start += len(group)
    return rows


def measure(batch: int, dim: int, rows: torch.Tensor | None, extra: int, warps: int | None = None,
            samples: int | None = None) -> dict:
    """Forward and backward microseconds, registers and spills with row map `rows` (None: plain) over
    a buffer of batch * 26 + extra rows; `warps`, `samples`: the launch (default: the module's)."""
    dev, features = torch.device("cuda"), 27
    dense = torch.randn(batch, dim, device=dev, dtype=torch.bfloat16)
    emb = torch.randn(batch * 26 + extra, dim, device=dev, dtype=torch.bfloat16)
    width = -(-(dim + features * (features - 1) // 2) // 8) * 8
    out = torch.empty(batch, width, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(out)
    d_dense, d_emb = torch.empty_like(dense), torch.empty_like(emb)
    mapped = rows is not None
    rmap = rows.to(dev).contiguous() if mapped else dense
    samples = samples or fi._SAMPLES
    grid = (triton.cdiv(batch, samples),)
    common = dict(F=features, FP=fi._block(features), D=dim, SAMPLES=samples, IEEE=False, MAPPED=mapped)
    options = getattr(fi, "launch_options", lambda *_: {"num_warps": 4})  # 4 warps where the module sets none
    fwd_opts, bwd_opts = ({**options(mapped, back), **({"num_warps": warps} if warps else {})} for back in (0, 1))
    pairs = features * (features - 1) // 2

    def forward():
        return fi.interaction_kernel[grid](dense, emb, rmap, out, batch, PAIRS=pairs, W=width,
                                           PADP=triton.next_power_of_2(max(width - dim - pairs, 1)), **common,
                                           **fwd_opts)

    def backward():
        return fi.interaction_backward_kernel[grid](dense, emb, rmap, grad, d_dense, d_emb, grad.stride(0), batch,
                                                    **common, **bwd_opts)

    kernels = {"fwd": forward(), "bwd": backward()}
    record = {"forward_us": round(median_ms(forward) * 1e3, 1), "backward_us": round(median_ms(backward) * 1e3, 1)}
    for name, k in kernels.items():
        record[f"{name}_regs"], record[f"{name}_spills"] = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--sweep", action="store_true", help="also every warps x samples pair (plain, exchange)")
    args = p.parse_args()
    identity = torch.stack([torch.zeros(26, dtype=torch.int64), torch.full((26,), 26), torch.arange(26)])
    gap = 37  # rows: the blocks no longer start a power of two apart
    layouts = {"plain": (None, 0), "identity": (identity, 0), "exchange": (exchange_rows(0), 0),
               "exchange-gaps": (exchange_rows(gap), 5 * gap)}
    record = {"benchmark": "interaction_layout", "device": torch.cuda.get_device_name(), "batch": args.batch,
              "dim": args.dim}
    for name, (rows, extra) in layouts.items():
        record[name] = measure(args.batch, args.dim, rows, extra)
    print(json.dumps(record), flush=True)
    for warps in (4, 8) if args.sweep else ():
        for samples in (8, 16):
            line = {"warps": warps, "samples": samples}
            for name in ("plain", "exchange"):
                line[name] = measure(args.batch, args.dim, *layouts[name], warps=warps, samples=samples)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
