"""Training throughput of ctrflow's fused GPU path against a naive PyTorch DLRM, in one run.

    PYTHONPATH=src python3 benchmarks/train_throughput.py [--model dlrm|dcnv2] [--small]

Trains the real ctrflow model (MLPerf Criteo-1TB tables, dim 128) on synthetic batches kept on the
GPU (Zipf-skewed ids, rotated, so no host loader is involved): the naive baseline (26 sparse
`nn.EmbeddingBag`s + torch SGD, bf16 autocast, eager) and the fast path (`FusedEmbeddingCollection`,
bf16 autocast, the whole step captured in one CUDA graph). Then trains the plain path (fp32
`EmbeddingCollection`, torch optimizers) and the fast path on the same batches at smaller table
sizes and compares their AUC. Prints one JSON line. `--small` runs in seconds on a CPU.
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
import torch.nn.functional as F
from torch import nn

from ctrflow.data.schema import SPARSE
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.dense import align_linear_inputs
from ctrflow.embedding.fused.interaction import FusedDotInteraction
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.embedding.tables import tables_for
from ctrflow.models import build_model, replace_module
from ctrflow.models.layers import DotInteraction

MLPERF_TABLES = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]
ARCH = {  # MLPerf shapes; DCNv2: 3 cross layers of rank 512
    "dlrm": {"bottom_mlp": (512, 256), "top_mlp": (1024, 1024, 512, 256)},
    "dcnv2": {"bottom_mlp": (512, 256), "deep_mlp": (1024, 1024, 512, 256), "cross_layers": 3, "cross_rank": 512},
}
SMALL_ARCH = {"dlrm": {"bottom_mlp": (32, 16), "top_mlp": (64, 32)},
              "dcnv2": {"bottom_mlp": (32, 16), "deep_mlp": (64, 32), "cross_layers": 2, "cross_rank": 8}}
# (dense optimizer, lr, table optimizer, lr). Speed: MLPerf's choices. Quality: ctrflow's default
# Adam + LazyAdam (plain SGD barely moves this deep MLP in 150 steps), row-wise Adagrad for DCNv2.
SPEED_OPTIM = {"dlrm": ("sgd", 0.5, "sgd", 0.5), "dcnv2": ("adam", 1e-3, "rowwise_adagrad", 0.01)}
QUALITY_OPTIM = {"dlrm": ("adam", 1e-3, "adam", 1e-2), "dcnv2": ("adam", 1e-3, "rowwise_adagrad", 0.05)}
TABLE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.SparseAdam, "rowwise_adagrad": RowwiseAdagrad}


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


class NaiveBags(nn.Module):
    """The naive baseline's sparse arch: one `nn.EmbeddingBag` (sparse gradients) per table."""

    def __init__(self, sizes: list[int], dim: int, device: torch.device):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True, device=device) for n in sizes)
        for bag, n in zip(self.bags, sizes):
            nn.init.uniform_(bag.weight, -n ** -0.5, n ** -0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(ids[:, i:i + 1]) for i, bag in enumerate(self.bags)], dim=1)  # [B, 26, D]


def build_path(kind: str, args, sizes: list[int], device: torch.device, optim: tuple):
    """(model, step function) for `kind`: naive | fused | fused-eager (no graph) | fused-compile
    (graph + torch.compile'd dense parts) | fused-compile-head (graph + the model's whole `head`,
    everything after the lookup, compiled as one graph; DCNv2) | plain (see the module doc)."""
    arch = (SMALL_ARCH if args.small else ARCH)[args.model]
    if kind == "plain":
        model = build_model(args.model, sizes, args.dim, **arch).to(device)
        tables = [p for p in model.embeddings.weights.values()]
    else:
        # tiny tables: the dense layers come out the same, and no 96 GB is drawn on the host
        model = build_model(args.model, [1] * len(SPARSE), args.dim, **arch)
        if kind == "naive":
            replace_module(model, "embeddings", NaiveBags(sizes, args.dim, device))
            tables = list(model.embeddings.parameters())
        else:
            scope = {"fused-compile": "parts", "fused-compile-head": "head"}.get(kind, "")
            make_fast(model, args, sizes, device, optim, compile_scope=scope)
            tables = []
        model.to(device)
    graphs = device.type == "cuda" and kind in ("fused", "fused-compile", "fused-compile-head")
    opts = make_optimizers(model, tables, optim, naive=kind == "naive", capturable=graphs)
    autocast = kind != "plain" and device.type == "cuda"

    def step(dense_x, ids, labels):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            logits = model(dense_x, ids)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        loss.backward()
        for opt in opts:
            opt.step()
        return loss.detach()

    return model, (capture_step(step, device) if graphs else step)


def make_optimizers(model: nn.Module, tables: list, optim: tuple, naive: bool, capturable: bool) -> list:
    """Dense optimizer over every parameter but `tables`, and the table optimizer over `tables`
    (none for the fused path, which updates its tables in backward)."""
    table_ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    dense_opt, dense_lr, table_opt, table_lr = optim
    if dense_opt == "sgd":
        opts = [torch.optim.SGD(dense, lr=dense_lr)]
    else:
        opts = [torch.optim.Adam(dense, lr=dense_lr, capturable=capturable)]
    if naive:  # the naive baseline is SGD: optimizer state for 96 GB of tables would not fit
        opts.append(torch.optim.SGD(tables, lr=table_lr))
    elif tables:
        opts.append(TABLE_OPTIMIZERS[table_opt](tables, lr=table_lr))
    return opts


def make_fast(model: nn.Module, args, sizes: list[int], device: torch.device, optim: tuple,
              compile_scope: str) -> None:
    """The fast path's swaps, each computing the same function: fused tables, fused dot interaction,
    tensor-core-aligned Linear inputs, and optionally torch.compile'd dense parts (`compile_scope`
    "parts": each dense module apart; "head": the model's `head` method as one graph, where the
    model has one)."""
    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # halves lookup + grad bytes
    replace_module(model, "embeddings", FusedEmbeddingCollection(
        tables_for(sizes, list(SPARSE), args.dim), seed=0, optimizer=optim[2], lr=optim[3], device=device,
        output_dtype=out_dtype, storage_dtype=getattr(torch, args.storage), check_ids=False,
        pre_reduce=not args.no_pre_reduce))
    if isinstance(model.interaction, DotInteraction):
        replace_module(model, "interaction", FusedDotInteraction.from_plain(model.interaction))
    if not args.no_align:
        align_linear_inputs(model)
    if compile_scope == "head" and hasattr(model, "head"):
        model.head = torch.compile(model.head, mode=args.compile_mode)  # instance attribute: forward finds it
    elif compile_scope:
        for name in ("dense_arch", "interaction", "over_arch"):
            replace_module(model, name, torch.compile(model.get_submodule(name), mode=args.compile_mode))


def capture_step(step, device: torch.device):
    """The whole training step as one CUDA graph; inputs are copied into its static tensors."""
    static: list[torch.Tensor] = []
    graph = torch.cuda.CUDAGraph()
    holder: dict = {}

    def run(*batch):
        if not static:
            static.extend(t.clone() for t in batch)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: kernel compiles, buffers, state
                for _ in range(3):
                    step(*static)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                holder["loss"] = step(*static)
        for dst, src in zip(static, batch):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return holder["loss"]

    return run


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


def write_profile(step, batches, path: str) -> None:
    """Per-kernel GPU time of three steps (a graph replay shows as one entry), as a table in `path`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for batch in batches[:3]:
            step(*batch)
        torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


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
    """Train the plain and the fast path on the same batches (tables capped at `quality_rows`);
    AUC of each on held-out batches."""
    sizes = [min(n, args.quality_rows) for n in (args.sizes)]
    train = make_batches(sizes, args.batch_size, args.quality_steps, device, seed=1)
    held = make_batches(sizes, args.batch_size, args.quality_eval_batches, device, seed=2)
    result = {"quality_steps": args.quality_steps, "quality_table_cap": args.quality_rows}
    for kind in ("plain", "fused-eager"):  # eager: the graph's warm-up steps would add updates
        model, step = build_path(kind, args, sizes, device, QUALITY_OPTIM[args.model])
        if kind != "plain":  # the same starting tables as the plain path
            arch = (SMALL_ARCH if args.small else ARCH)[args.model]
            plain_tables = build_model(args.model, sizes, args.dim, **arch).embeddings.full_weights()
            model.embeddings.weight.copy_(torch.cat(list(plain_tables.values())))
            del plain_tables
        for batch in train:
            step(*batch)
        model.eval()
        fast = kind != "plain" and device.type == "cuda"
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=fast):
            scores = torch.cat([model(d, i).float() for d, i, _ in held])
        name = "auc_plain" if kind == "plain" else "auc_fused"
        result[name] = auc(scores, torch.cat([lab for _, _, lab in held]))
        del model, step
        release(device)
    result["auc_diff"] = abs(result["auc_fused"] - result["auc_plain"])
    return result


def release(device: torch.device) -> None:
    """Free the last path's tables before the next path allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def parse(argv=None):
    """Command-line flags (defaults: the issue's MLPerf DLRM setting)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(ARCH), default="dlrm")
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--storage", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--paths", default=None, help="comma list of naive, fused, fused-eager, fused-compile, "
                   "fused-compile-head "
                   "(default: naive,fused,fused-compile; with --small naive,fused)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality-steps", type=int, default=150, help="0 skips the AUC comparison")
    p.add_argument("--quality-rows", type=int, default=200_000)
    p.add_argument("--quality-eval-batches", type=int, default=4)
    p.add_argument("--no-align", action="store_true", help="keep Linear inputs of odd widths (13, 479)")
    p.add_argument("--no-pre-reduce", action="store_true", help="one atomic row per position in backward")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--profile", default="", help="folder for per-kernel time tables of each path")
    p.add_argument("--small", action="store_true", help="tiny tables, dim 16, batch 512: seconds on a CPU")
    args = p.parse_args(argv)
    args.sizes = MLPERF_TABLES
    args.paths = args.paths or ("naive,fused" if args.small else "naive,fused,fused-compile")
    if args.small:
        args.sizes = [min(n, 1000) for n in MLPERF_TABLES]
        args.dim, args.batch_size, args.steps, args.repeats = 16, 512, 3, 3
        args.warmup, args.quality_steps, args.quality_rows = 1, min(args.quality_steps, 20), 1000
    return args


def main(argv=None) -> dict:
    """Run every requested path, then the AUC comparison; print and return one JSON-able dict."""
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = make_batches(args.sizes, args.batch_size, 4, device, seed=0)
    result = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "world_size": 1, "batch": args.batch_size, "dim": args.dim, "small": args.small,
              "precision": f"bf16 autocast, {args.storage} tables" if device.type == "cuda" else "fp32",
              "table_rows": sum(args.sizes)}
    for kind in args.paths.split(","):
        model, step = build_path(kind, args, args.sizes, device, SPEED_OPTIM[args.model])
        t0 = time.perf_counter()
        result[kind] = measure(step, batches, args, device)
        print(json.dumps({kind: result[kind], "seconds": round(time.perf_counter() - t0, 1)}), file=sys.stderr,
              flush=True)  # partial results survive a time limit
        if args.profile and device.type == "cuda":
            write_profile(step, batches, f"{args.profile}/{args.model}-{kind}.txt")
        del model, step
        release(device)
    fast = [k for k in ("fused", "fused-compile", "fused-compile-head", "fused-eager") if k in result]
    if "naive" in result and fast:
        best = max(fast, key=lambda k: result[k]["samples_per_s"])
        result["best_fast_path"] = best
        result["ratio"] = result[best]["samples_per_s"] / result["naive"]["samples_per_s"]
    if args.quality_steps:
        result.update(compare_quality(args, device))
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
