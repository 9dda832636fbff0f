"""MLPerf DLRMv2 training throughput on one GPU: ctrflow's fast path against a naive PyTorch baseline.

    PYTHONPATH=src python3 benchmarks/dlrmv2.py [--paths naive,fast,fast:fp8] [--small]

The MLPerf Training DLRMv2 shape: DCNv2 over the multi-hot Criteo-1TB tables (26 tables, 204 M rows,
214 ids a sample, sum pooling), dim 128, bottom MLP 512-256-128, three low-rank (512) cross layers over
27 x 128, top MLP 1024-1024-512-256-1, the whole global batch of 55,296 on one GPU, synthetic
Zipf-skewed ids drawn on the GPU (rotated, so no host loader is involved). Paths (`kind[:option...]`):

- `naive`: 26 `nn.EmbeddingBag`s (sum, sparse gradients) with torch's SGD on the tables (torch's
  Adagrad keeps a dense state per table, which does not fit beside them), the plain DCNv2 with torch's
  Adam, bf16 autocast, eager;
- `fast`: ctrflow's `FusedEmbeddingCollection` (bags gathered and pooled in one kernel, row-wise
  Adagrad applied in the backward), the dense part in bf16 (`:fp8`: `ctrflow train --precision fp8`'s
  rule), the head compiled, the whole step one CUDA graph; `fast-eager`: the same, neither compiled
  nor graphed (CPU, and the AUC comparison); option `nocompile`: the head not compiled;
- `tables`: the fast path's tables alone (lookup, then the backward's update from a fixed gradient).

Prints one JSON line: samples/s of each path, the naive baseline, the best fast path's ratio to it,
GPU, batch, precision, world size, peak memory. With `--quality-steps N` it also trains the plain fp32
path (`EmbeddingCollection`, torch optimizers) and the eager fast path in each precision timed on the
same batches (tables capped) and compares their AUC. `--small` runs in seconds on a CPU. Imports only
torch, triton and ctrflow. `dlrmv2_tables`, `make_batches`, `fast_tables` and `build_path` are the pieces
other benchmarks of this shape reuse (`dlrmv2_scale.py`: the shape on N GPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.accel.accelerate import accelerate
from ctrflow.accel.plan import RunPlan
from ctrflow.contract.features import Feature, Features
from ctrflow.models import build_model
from ctrflow.runtime import Runtime

sys.path.insert(0, str(Path(__file__).parent))
from train_paths import SMALL_ARCH, capture_step, fp8_plan, make_optimizers, make_step  # noqa: E402
from train_paths import split_path as split_any_path  # noqa: E402
from train_throughput import auc, measure, release, write_profile  # noqa: E402

# MLPerf Training DLRMv2 (the reference's and NVIDIA's train.py): rows and multi-hot size of each table
ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4,
        976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
HOTNESS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
BATCH = 55296  # MLPerf's global batch
ARCH = {"bottom_mlp": (512, 256), "deep_mlp": (1024, 1024, 512, 256), "cross_layers": 3, "cross_rank": 512}
# (dense optimizer, lr, table optimizer, lr): NVIDIA's table Adagrad rate; dense Adam as ctrflow trains DCNv2
OPTIM = ("adam", 1e-3, "rowwise_adagrad", 0.004)
KINDS = ("naive", "fast", "fast-eager", "tables", "plain")
OPTIONS = ("fp8", "nocompile")


def dlrmv2_features(rows: list[int], hotness: list[int]) -> Features:
    """13 dense inputs and one sparse feature a table: categorical where one id a sample, else a sum bag."""
    sparse = tuple(Feature(f"C{i + 1}", "categorical", cardinality=n) if k == 1 else
                   Feature(f"C{i + 1}", "multi_hot", cardinality=n, max_length=k, pooling="sum")
                   for i, (n, k) in enumerate(zip(rows, hotness)))
    return Features(dense=tuple(Feature(f"I{i + 1}", "dense", transform="log1p") for i in range(13)), sparse=sparse)


def dlrmv2_tables(rows: list[int], hotness: list[int], dim: int):
    """The fast path's `TableConfig`s of this shape (`ctrflow.embedding.tables.tables_for`)."""
    from ctrflow.embedding.tables import tables_for

    return tables_for(dlrmv2_features(rows, hotness).sparse, dim)


def make_batches(rows: list[int], hotness: list[int], batch: int, count: int, device: torch.device,
                 seed: int) -> list[tuple]:
    """`count` batches (dense [B, 13], ids [B, sum(hotness)], labels [B]) drawn on `device`.

    Each slot's rank k has probability ~ 1/(k+1) in its table (Zipf, exponent 1), ranks hashed over the
    table so hot rows are scattered; a bag's ids avoid 0, which a ctrflow bag reads as padding (MLPerf's
    bags are full). Labels: Bernoulli of a hidden teacher over every table's mean per-id effect and two
    dense values.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    owner = torch.tensor([t for t, k in enumerate(hotness) for _ in range(k)], device=device)
    n = torch.tensor(rows, device=device, dtype=torch.int64)[owner]  # [S] each slot's table size
    first = torch.tensor([0 if k == 1 else 1 for k in hotness], device=device)[owner]  # bags skip id 0
    span = torch.clamp(n - first, min=1)
    salt = owner * 7919
    per_table = torch.zeros(len(owner), len(rows), device=device)
    per_table[torch.arange(len(owner), device=device), owner] = 1 / torch.tensor(hotness, device=device)[owner].float()
    out = []
    for _ in range(count):
        u = torch.rand(batch, len(owner), generator=gen, device=device, dtype=torch.float64)
        rank = torch.minimum(torch.exp(u * torch.log1p(span.double())).long() - 1, span - 1)
        ids = first + (rank * 2654435761 + salt) % span
        # 1 - rand is in (0, 1]: log(0) = -inf once in 2^24 draws would poison training with NaN
        dense = torch.log1p(-torch.log(1 - torch.rand(batch, 13, generator=gen, device=device)) * 8)
        score = ((ids * 40503 + salt) % 1009).float() / 1009 - 0.5  # [B, S] hidden per-id effects
        logit = 4 * (score @ per_table).mean(dim=1) * 5 ** 0.5 + 0.5 * (dense[:, 0] - dense[:, 1])
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        out.append((dense, ids, labels))
    return out


class NaiveBags(nn.Module):
    """The naive baseline's tables: one `nn.EmbeddingBag` (sum, sparse gradients) per table, each fed its
    [B, hotness] slice of the ids."""

    def __init__(self, rows: list[int], hotness: list[int], dim: int, device: torch.device):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True, device=device) for n in rows)
        for bag, n in zip(self.bags, rows):
            nn.init.uniform_(bag.weight, -n ** -0.5, n ** -0.5)
        self.starts = [sum(hotness[:i]) for i in range(len(hotness))]
        self.hotness = list(hotness)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(ids[:, s:s + k]) for bag, s, k in zip(self.bags, self.starts, self.hotness)], dim=1)


def split_path(name: str) -> tuple[str, set[str]]:
    """`"fast:fp8"` -> ("fast", {"fp8"}); ValueError on unknown parts."""
    return split_any_path(name, KINDS, OPTIONS)


def precision_of(name: str, device: torch.device) -> str:
    """What the path computes in, for the JSON line."""
    kind, options = split_path(name)
    if kind == "plain" or device.type != "cuda":
        return "fp32"
    dense = "fp8 products of Linear >= 512 wide + bf16 autocast" if "fp8" in options else "bf16 autocast"
    return dense + ("; fp32 tables" if kind == "naive" else "; fp32 tables, bf16 lookups")


def base_model(args, features: Features) -> nn.Module:
    """The DCNv2 of this shape (its dense layers; the tables are each path's own)."""
    return build_model("dcnv2", features, args.dim, **(SMALL_ARCH["dcnv2"] if args.small else ARCH))


def fast_tables(args, rows: list[int], device: torch.device) -> FusedEmbeddingCollection:
    """The fast path's tables: one `FusedEmbeddingCollection` drawn on `device`, row-wise Adagrad in the
    backward, lookups in bf16 on CUDA."""
    return FusedEmbeddingCollection(
        dlrmv2_tables(rows, HOTNESS, args.dim), seed=0, optimizer=OPTIM[2], lr=OPTIM[3], device=device,
        output_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, check_ids=False)


def build_path(name: str, args, rows: list[int], device: torch.device):
    """(model, step function (dense, ids, labels) -> loss) of path `name` (module doc)."""
    kind, options = split_path(name)
    if kind == "tables":
        return build_tables_path(args, rows, device)
    tiny = dlrmv2_features([1] * len(rows), HOTNESS)  # the dense layers only: no 97 GiB drawn on the host
    model = base_model(args, dlrmv2_features(rows, HOTNESS) if kind == "plain" else tiny)
    cuda = device.type == "cuda"
    if kind == "plain":
        model.to(device)
        tables = list(model.embeddings.weights.values())
    elif kind == "naive":
        model.embeddings = NaiveBags(rows, HOTNESS, args.dim, device)
        model.to(device)
        tables = list(model.embeddings.parameters())
    else:
        model.embeddings = fast_tables(args, rows, device)
        compiled = cuda and kind == "fast" and "nocompile" not in options
        plan = RunPlan(device=str(device), embedding="fused", autocast="bf16" if cuda else "fp32",
                       fp8=fp8_plan(args, options), align_linear=cuda, compile="head" if compiled else "off")
        accelerate(model, plan, Runtime(0, 1, device.index or 0, device))
        model.to(device)
        tables = []
    graphs = cuda and kind == "fast"
    opts = make_optimizers(model, tables, OPTIM, naive=kind == "naive", capturable=graphs,
                           fused=cuda and kind.startswith("fast"))
    if kind == "plain":
        opts[-1] = RowwiseAdagrad(tables, lr=OPTIM[3])
    step = make_step(model, opts, device, autocast=cuda and kind != "plain")
    return model, (capture_step(step, device) if graphs else step)


def build_tables_path(args, rows: list[int], device: torch.device):
    """The fast path's tables alone: lookup, then backward (the row-wise Adagrad update) from a fixed
    pooled gradient; graphed on CUDA."""
    tables = fast_tables(args, rows, device)
    grad = torch.randn(args.batch_size, len(rows), args.dim, device=device).to(tables.output_dtype) * 1e-3

    def step(dense, ids, labels):
        pooled = tables(ids)
        pooled.backward(grad)
        return pooled.detach()[0, 0, 0].float()

    return tables, (capture_step(step, device) if device.type == "cuda" else step)


def compare_quality(args, device: torch.device) -> dict:
    """AUC on held-out batches after `quality_steps` steps of the plain fp32 path and the eager fast path
    in each precision timed, from the same tables (capped at `quality_rows`), `quality_seeds` times on
    other batches; means of the AUCs and of each path's signed difference to plain."""
    rows = [min(n, args.quality_rows) for n in ROWS]
    held = make_batches(rows, HOTNESS, args.batch_size, args.quality_eval_batches, device, seed=2)
    labels = torch.cat([lab for _, _, lab in held])
    names = ["plain", "fast-eager"] + (["fast-eager:fp8"] if "fp8" in args.paths and device.type == "cuda" else [])
    aucs: dict[str, list[float]] = {name: [] for name in names}
    for k in range(args.quality_seeds):
        train = make_batches(rows, HOTNESS, args.batch_size, args.quality_steps, device, seed=100 + k)
        for name in names:
            aucs[name].append(train_and_score(name, args, rows, device, train, held, labels))
            print(json.dumps({"auc_" + name: aucs[name][-1], "seed": k}), file=sys.stderr, flush=True)
        del train
    result = {"quality_steps": args.quality_steps, "quality_seeds": args.quality_seeds,
              "quality_table_cap": args.quality_rows, "auc_plain": statistics.mean(aucs["plain"])}
    for name in names[1:]:
        key = name.replace("fast-eager", "fast").replace(":", "_")
        result["auc_" + key] = statistics.mean(aucs[name])
        result["auc_diff_" + key] = statistics.mean(a - b for a, b in zip(aucs[name], aucs["plain"]))
    return result


def train_and_score(name: str, args, rows: list[int], device: torch.device, train: list, held: list,
                    labels: torch.Tensor) -> float:
    """AUC on `held` of path `name` after one pass over `train`, from the plain path's tables."""
    model, step = build_path(name, args, rows, device)
    if name != "plain":
        plain = base_model(args, dlrmv2_features(rows, HOTNESS)).embeddings.full_weights()
        model.embeddings.load_full_weights(plain)
    for batch in train:
        step(*batch)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=name != "plain" and device.type == "cuda"):
        scores = torch.cat([model(d, i).float() for d, i, _ in held])
    del model, step
    release(device)
    return auc(scores, labels)


def parse(argv=None):
    """Command-line flags (defaults: the MLPerf shape on one GPU)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default=None, help="comma list of kind[:option...] (module doc); default "
                   "naive,fast,fast:fp8 (with --small naive,fast-eager,tables)")
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quality-steps", type=int, default=0, help="train steps of the AUC comparison (0: none)")
    p.add_argument("--quality-rows", type=int, default=200_000, help="table rows cap of the AUC comparison")
    p.add_argument("--quality-eval-batches", type=int, default=8)
    p.add_argument("--quality-seeds", type=int, default=3)
    p.add_argument("--profile", default="", help="folder for each path's per-kernel time table")
    p.add_argument("--small", action="store_true", help="tables of at most 1000 rows, dim 16, batch 128: a CPU")
    args = p.parse_args(argv)
    args.rows = list(ROWS)
    if args.paths is None:
        args.paths = "naive,fast-eager,tables" if args.small else "naive,fast,fast:fp8"
    if args.small:
        args.rows = [min(n, 1000) for n in ROWS]
        args.dim, args.batch_size, args.warmup, args.steps, args.repeats = 16, 128, 1, 1, 1
        args.quality_rows, args.quality_eval_batches = 1000, 2
    args.no_align = False  # `train_paths.fp8_plan` reads these
    return args


def main(argv=None) -> dict:
    """Time every path in `--paths`, then the optional AUC comparison; print and return one JSON line."""
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = make_batches(args.rows, HOTNESS, args.batch_size, 4, device, seed=0)
    result = {"shape": "mlperf-dlrmv2", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "world_size": 1, "batch": args.batch_size, "dim": args.dim, "small": args.small,
              "table_rows": sum(args.rows), "ids_per_sample": sum(HOTNESS)}
    for name in filter(None, args.paths.split(",")):
        model, step = build_path(name, args, args.rows, device)
        t0 = time.perf_counter()
        result[name] = {"precision": precision_of(name, device), **measure(step, batches, args, device)}
        result[name]["ms_per_step"] = round(1000 * args.batch_size / result[name]["samples_per_s"], 3)
        if args.profile and device.type == "cuda":
            result[name].update(write_profile(step, batches, f"{args.profile}/dlrmv2-{name.replace(':', '_')}.txt"))
        if device.type == "cuda":
            result[name]["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        print(json.dumps({name: result[name], "seconds": round(time.perf_counter() - t0, 1)}), file=sys.stderr,
              flush=True)  # partial results survive a time limit
        del model, step
        release(device)
    add_ratio(result)
    if args.quality_steps:
        result.update(compare_quality(args, device))
    print(json.dumps(result))
    return result


def add_ratio(result: dict) -> None:
    """The fastest timed training path other than the naive one, and its ratio to the naive path."""
    timed = [k for k, v in result.items() if isinstance(v, dict) and k.split(":")[0] in ("fast", "fast-eager")]
    if "naive" in result and timed:
        best = max(timed, key=lambda k: result[k]["samples_per_s"])
        result["naive_samples_per_s"] = result["naive"]["samples_per_s"]
        result["best_path"], result["best_samples_per_s"] = best, result[best]["samples_per_s"]
        result["ratio"] = result[best]["samples_per_s"] / result["naive"]["samples_per_s"]


if __name__ == "__main__":
    main()
