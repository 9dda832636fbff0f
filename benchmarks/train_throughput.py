"""Training throughput of ctrflow's fused GPU path against a naive PyTorch DLRM, in one run.

    PYTHONPATH=src python3 benchmarks/train_throughput.py [--model dlrm|dcnv2] [--small]

Trains the real ctrflow model (MLPerf Criteo-1TB tables, dim 128) on synthetic batches kept on the
GPU (Zipf-skewed ids, rotated, so no host loader is involved): the naive baseline (26 sparse
`nn.EmbeddingBag`s + torch SGD, bf16 autocast, eager) and the fast path (`FusedEmbeddingCollection`,
bf16 autocast, the whole step captured in one CUDA graph; `train_paths.py` names every path and
option, e.g. `fused-compile-head:fp8`). Then trains the plain path (fp32 `EmbeddingCollection`,
torch optimizers) and the eager fast path (in each precision timed) on the same batches at smaller
table sizes and compares their AUC. Prints one JSON line. `--small` runs in seconds on a CPU.
Imports only torch and ctrflow (no kfp/mlflow), as the GPU machine has nothing else.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from ctrflow.models import build_model
from ctrflow.contract.features import Features
from train_paths import ARCH, PRECISION_OPTIONS, SMALL_ARCH, build_path, precision_of, split_path

MLPERF_TABLES = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]
# (dense optimizer, lr, table optimizer, lr). Speed: MLPerf's choices. Quality: ctrflow's default
# Adam + LazyAdam (plain SGD barely moves this deep MLP in 150 steps), row-wise Adagrad for DCNv2.
SPEED_OPTIM = {"dlrm": ("sgd", 0.5, "sgd", 0.5), "dcnv2": ("adam", 1e-3, "rowwise_adagrad", 0.01)}
QUALITY_OPTIM = {"dlrm": ("adam", 1e-3, "adam", 1e-2), "dcnv2": ("adam", 1e-3, "rowwise_adagrad", 0.05)}


def make_batches(sizes: list[int], batch: int, count: int, device: torch.device, seed: int) -> list[tuple]:
    """`count` batches (dense [B,13], ids [B,26], labels [B]) drawn on `device`.

    Ids: rank k of table n has probability ~ 1/(k+1) (Zipf, exponent 1), ranks hashed over the table
    so hot rows are scattered. Labels: Bernoulli of a hidden teacher over ids and dense values.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    n = torch.tensor(sizes, device=device, dtype=torch.int64)
    salt = torch.arange(len(sizes), device=device) * 7919
    out = []
    for _ in range(count):
        u = torch.rand(batch, len(sizes), generator=gen, device=device, dtype=torch.float64)
        rank = torch.minimum(torch.exp(u * torch.log1p(n.double())).long() - 1, n - 1)
        ids = (rank * 2654435761 + salt) % n
        # 1 - rand is in (0, 1]: log(0) = -inf once in 2^24 draws would poison training with NaN
        dense = torch.log1p(-torch.log(1 - torch.rand(batch, 13, generator=gen, device=device)) * 8)
        score = ((ids * 40503 + salt) % 1009).float() / 1009 - 0.5  # [B, 26] hidden per-id effects
        logit = 4 * score.mean(dim=1) * 5 ** 0.5 + 0.5 * (dense[:, 0] - dense[:, 1])
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        out.append((dense, ids, labels))
    return out


def measure(step, batches, args, device: torch.device) -> dict:
    """Median samples/s over `repeats` timed runs of `steps` steps, after `warmup` steps."""
    first = None
    for i in range(args.warmup):
        loss = step(*batches[i % len(batches)])
        first = float(loss) if first is None else first  # the same start on every fast path: compare
    rates = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for i in range(args.steps):
            loss = step(*batches[i % len(batches)])
        if device.type == "cuda":
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            seconds = time.perf_counter() - t0
        rates.append(args.steps * args.batch_size / seconds)
    return {"samples_per_s": statistics.median(rates), "spread": (max(rates) - min(rates)) / statistics.median(rates),
            "first_loss": first, "final_loss": float(loss)}


def write_profile(step, batches, path: str) -> dict:
    """Per-kernel GPU time of three steps, as a table in `path` (their timeline beside it); returns the
    GPU time per step (sum of kernel times) against the wall time per step of the same three steps (CUDA
    events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        for batch in batches[:3]:
            step(*batch)
        end.record()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1000 / 3
    wall_ms = start.elapsed_time(end) / 3
    prof.export_chrome_trace(path.removesuffix(".txt") + ".json.gz")  # the timeline: what overlaps what
    with open(path, "w") as f:
        f.write(f"GPU time (sum of kernels) {gpu_ms:.3f} ms/step; wall (events) {wall_ms:.3f} ms/step\n")
        f.write(events.table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=70))
    return {"gpu_ms_per_step": round(gpu_ms, 3), "profiled_wall_ms_per_step": round(wall_ms, 3)}


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve by ranks (ties have measure zero for float scores); NaN if any
    score is not finite (a diverged model)."""
    if not bool(torch.isfinite(scores).all()):
        return float("nan")
    order = torch.argsort(scores.double())
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, device=scores.device, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def compare_quality(args, device: torch.device) -> dict:
    """Train the plain path and the eager fast path in each precision timed (tables capped at
    `quality_rows`) on the same batches; AUC of each on held-out batches. With `quality_seeds` > 1,
    every path trains once per seed on its own batches (seed 1, then 101, 102, ...) and the AUCs and
    their signed differences to plain are averaged: the fast paths' 100-step AUC moves by up to ~1e-3
    from run to run (atomic adds, bf16/fp8 roundings), so one run's |difference| measures that noise
    as much as a bias; the mean of k paired differences has 1/sqrt(k) of its spread."""
    sizes = [min(n, args.quality_rows) for n in (args.sizes)]
    held = make_batches(sizes, args.batch_size, args.quality_eval_batches, device, seed=2)
    labels = torch.cat([lab for _, _, lab in held])
    result = {"quality_steps": args.quality_steps, "quality_table_cap": args.quality_rows,
              "quality_seeds": args.quality_seeds, "quality_eval_rows": len(labels)}
    aucs: dict[str, list[float]] = {}
    for k in range(args.quality_seeds):
        train = make_batches(sizes, args.batch_size, args.quality_steps, device, seed=1 if k == 0 else 100 + k)
        # eager: the graph's warm-up steps would add updates
        for name in ("plain", *quality_paths(args.quality_paths or args.paths)):
            key = "auc_plain" if name == "plain" else "auc_fused" + name.removeprefix("fused-eager").replace(":", "_")
            aucs.setdefault(key, []).append(train_and_score(name, args, sizes, device, train, held, labels))
            print(json.dumps({key: aucs[key][-1], "seed": k}), file=sys.stderr, flush=True)
        del train
    plain = aucs.pop("auc_plain")
    result["auc_plain"] = statistics.mean(plain)
    for key, values in aucs.items():
        diffs = [a - b for a, b in zip(values, plain)]
        result[key] = statistics.mean(values)
        result[key.replace("auc_fused", "auc_diff")] = abs(statistics.mean(diffs))  # the gate's number
        if args.quality_seeds > 1:
            result[key.replace("auc_fused", "auc_diffs")] = [round(d, 6) for d in diffs]  # signed, per seed
    return result


def train_and_score(name: str, args, sizes: list[int], device: torch.device, train: list, held: list,
                    labels: torch.Tensor) -> float:
    """AUC on `held` of path `name` after one pass over `train` from the plain path's tables."""
    model, step = build_path(name, args, sizes, device, QUALITY_OPTIM[args.model])
    if name != "plain":  # the same starting tables as the plain path
        arch = (SMALL_ARCH if args.small else ARCH)[args.model]
        plain_tables = build_model(args.model, Features.categorical(sizes, 13), args.dim, **arch).embeddings.full_weights()
        model.embeddings.weight.copy_(torch.cat(list(plain_tables.values())))
        del plain_tables
    for batch in train:
        step(*batch)
    model.eval()
    fast = name != "plain" and device.type == "cuda"
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=fast):
        scores = torch.cat([model(d, i).float() for d, i, _ in held])
    del model, step
    release(device)
    return auc(scores, labels)


def quality_paths(paths: str) -> list[str]:
    """The eager fast path once per distinct precision among the timed `paths` (bf16 always)."""
    out = ["fused-eager"]
    for name in filter(None, paths.split(",")):
        kind, options = split_path(name)
        precision = sorted(options & PRECISION_OPTIONS)
        if kind != "naive" and precision and "fused-eager:" + ":".join(precision) not in out:
            out.append("fused-eager:" + ":".join(precision))
    return out


def release(device: torch.device) -> None:
    """Free the last path's tables before the next path allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def parse(argv=None):
    """Command-line flags (defaults: the MLPerf DLRM setting)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(ARCH), default="dlrm")
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--storage", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--paths", default=None, help="comma list of paths kind[:option...] (train_paths.py), e.g. "
                   "naive,fused-compile-head,fused-compile-head:fp8 "
                   "(default: naive,fused,fused-compile; with --small naive,fused)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality-steps", type=int, default=150, help="0 skips the AUC comparison")
    p.add_argument("--quality-rows", type=int, default=200_000)
    p.add_argument("--quality-eval-batches", type=int, default=16, help="held-out batches for the AUC")
    p.add_argument("--quality-paths", default=None, help="comma list of paths whose precisions the AUC "
                   "comparison checks (default: --paths; an empty --paths then times nothing)")
    p.add_argument("--quality-seeds", type=int, default=1, help="train each quality path this many times "
                   "on other batches; AUCs and differences averaged (compare_quality)")
    p.add_argument("--no-align", action="store_true", help="keep Linear inputs of odd widths (13, 479)")
    p.add_argument("--no-pre-reduce", action="store_true", help="one atomic row per position in backward")
    p.add_argument("--embedding-l2", type=float, default=0.0,
                   help="the fused tables' embedding L2 (`ctrflow train`'s default is 1e-2; MLPerf's preset 0)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--profile", default="", help="folder for per-kernel time tables of each path")
    p.add_argument("--small", action="store_true", help="tiny tables, dim 16, batch 512: seconds on a CPU")
    args = p.parse_args(argv)
    args.sizes = MLPERF_TABLES
    if args.paths is None:
        args.paths = "naive,fused" if args.small else "naive,fused,fused-compile"
    if args.small:
        args.sizes = [min(n, 1000) for n in MLPERF_TABLES]
        args.dim, args.batch_size, args.steps, args.repeats = 16, 512, 3, 3
        args.warmup, args.quality_steps, args.quality_rows = 1, min(args.quality_steps, 20), 1000
    return args


def add_ratios(result: dict) -> None:
    """Best fast path per precision (bf16; fp8 where timed) and its ratio to the naive path."""
    timed = [k for k, v in result.items() if isinstance(v, dict) and "samples_per_s" in v and k != "naive"]
    for label, group in (("", [k for k in timed if "fp8" not in k]), ("_fp8", [k for k in timed if "fp8" in k])):
        if "naive" in result and group:
            best = max(group, key=lambda k: result[k]["samples_per_s"])
            result["best_fast_path" + label] = best
            result["ratio" + label] = result[best]["samples_per_s"] / result["naive"]["samples_per_s"]


def main(argv=None) -> dict:
    """Run every requested path, then the AUC comparison; print and return one JSON-able dict."""
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = make_batches(args.sizes, args.batch_size, 4, device, seed=0)
    result = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "world_size": 1, "batch": args.batch_size, "dim": args.dim, "small": args.small,
              "precision": f"per path (below); {args.storage} tables",
              "table_rows": sum(args.sizes)}
    for name in filter(None, args.paths.split(",")):
        model, step = build_path(name, args, args.sizes, device, SPEED_OPTIM[args.model])
        t0 = time.perf_counter()
        result[name] = {"precision": precision_of(name, device), **measure(step, batches, args, device)}
        if args.profile and device.type == "cuda":
            table = f"{args.profile}/{args.model}-{name.replace(':', '_')}.txt"
            result[name].update(write_profile(step, batches, table))
        result[name]["wall_ms_per_step"] = round(1000 * args.batch_size / result[name]["samples_per_s"], 3)
        print(json.dumps({name: result[name], "seconds": round(time.perf_counter() - t0, 1)}), file=sys.stderr,
              flush=True)  # partial results survive a time limit
        del model, step
        release(device)
    add_ratios(result)
    if args.quality_steps:
        result.update(compare_quality(args, device))
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
