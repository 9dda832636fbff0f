"""The training paths that `train_throughput.py` times: how each one is built, and its step.

A path is named `kind[:option...]`: kind is naive | fused | fused-eager (no graph) | fused-compile
(graph + each dense module torch.compile'd) | fused-compile-head (graph + the model's whole `head`,
everything after the lookup, compiled as one graph; DCNv2) | loop (what `ctrflow train` runs on one
GPU: its run plan and `accelerate` (`ctrflow.accel`), the loop's own `train_step` under
`ctrflow.accel.graphs.GraphedStep`, the loop's optimizers; dense Adam: DCNv2's, for DLRM `ctrflow train`'s default lr
1e-3 with the tables' SGD of the other paths) | plain (fp32 `EmbeddingCollection`,
torch optimizers: the quality reference). Options: `fp8` (what `ctrflow train --precision fp8` does:
`ctrflow.accel.fp8.apply.apply_fp8`'s defaults: both products of every Linear >= 512 wide in fp8, row
scales, e5m2 gradients, fast accumulation), `fp8w` (only the products whose quantized operand is
the narrow side), `fp8t` (one scale per tensor), `fp32acc` (fp32 accumulation), `e4m3g` (e4m3
gradients), `foreach` (torch's multi-tensor Adam instead of the fused one), `noalign` (with `loop`: the
13 dense inputs not padded), `unfused` (with an fp8
option: DCNv2's cross layers stay `Fp8Linear` by `Fp8Linear` under inductor instead
of `ctrflow.accel.fp8.cross.Fp8CrossNet`'s row kernels; same numbers up to bf16 roundings, so no AUC
check of its own), `noabsorb` (with `fp8`: the deep MLP's first Linear stays its own `Fp8Linear` in the
compiled graph instead of `Fp8CrossNet.absorb`ing it), `nocompile` (with `loop`: `ctrflow train
--compile off`: no compiled head (DCNv2) or dense parts (DLRM)), `bf16tab` (the fused tables stored in
bf16, updates computed in fp32: half the table bytes; `--storage` sets every path's), `beside` (with `fp8`:
`Fp8CrossNet`'s weight-gradient products on a side stream beside its row kernels; the default runs
them in line).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ctrflow.config import ModelConfig, OptimConfig, TrainConfig
from ctrflow.loaders.batch import Batch
from ctrflow.contract.criteo import SPARSE
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.reference import RowwiseAdagrad
from ctrflow.embedding.tables import tables_for
from ctrflow.models import build_model
from ctrflow.accel.accelerate import accelerate
from ctrflow.accel.plan import Fp8Plan, RunPlan, plan_run
from ctrflow.runtime import Runtime
from ctrflow.accel.fused import FusedTables
from ctrflow.accel.graphs import GraphedStep
from ctrflow.train.loop import train_step
from ctrflow.train.optim import build_optimizers
from ctrflow.contract.features import Features

ARCH = {  # MLPerf shapes; DCNv2: 3 cross layers of rank 512
    "dlrm": {"bottom_mlp": (512, 256), "top_mlp": (1024, 1024, 512, 256)},
    "dcnv2": {"bottom_mlp": (512, 256), "deep_mlp": (1024, 1024, 512, 256), "cross_layers": 3, "cross_rank": 512},
}
SMALL_ARCH = {"dlrm": {"bottom_mlp": (32, 16), "top_mlp": (64, 32)},
              "dcnv2": {"bottom_mlp": (32, 16), "deep_mlp": (64, 32), "cross_layers": 2, "cross_rank": 8}}
TABLE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.SparseAdam, "rowwise_adagrad": RowwiseAdagrad}
KINDS = ("naive", "fused", "fused-eager", "fused-compile", "fused-compile-head", "loop", "plain")
OPTIONS = ("fp8", "fp8w", "fp8t", "fp32acc", "e4m3g", "foreach", "unfused", "noabsorb", "nocompile", "noalign",
           "bf16tab", "beside")
FP8 = {"fp8", "fp8w", "fp8t"}
PRECISION_OPTIONS = FP8 | {"e4m3g", "fp32acc", "bf16tab"}  # options that change numbers: AUC-checked
GRAPHED = ("fused", "fused-compile", "fused-compile-head")


def split_path(name: str, kinds: tuple[str, ...] = KINDS, known: tuple[str, ...] = OPTIONS) -> tuple[str, set[str]]:
    """`"fused-compile-head:fp8"` -> ("fused-compile-head", {"fp8"}); ValueError on parts not in `kinds`
    and `known` (this module's paths by default)."""
    kind, *options = name.split(":")
    if kind not in kinds or not set(options) <= set(known):
        raise ValueError(f"unknown path {name!r}: kinds {', '.join(kinds)}; options {', '.join(known)}")
    return kind, set(options)


def precision_of(name: str, device: torch.device) -> str:
    """What the path's dense products compute in, for the JSON line."""
    kind, options = split_path(name)
    rest = "bf16 autocast" if kind != "plain" and device.type == "cuda" else "fp32"
    if options & FP8:
        grads = "e4m3" if "e4m3g" in options else "e5m2"
        scales = "tensor" if "fp8t" in options else "row"
        products = "narrow-operand products" if "fp8w" in options else "all products"
        accumulate = "fp32" if "fp32acc" in options else "fast"
        cross = "" if options & {"fp8w", "fp8t", "unfused"} else ", cross layers in row kernels"
        rest = (f"fp8 (Linear >= 512 wide, {products}: e4m3 x {grads} grads, {scales} scales, {accumulate} "
                f"accumulation{cross}) + {rest}")
    return rest + (", bf16 tables" if "bf16tab" in options else "")


class NaiveBags(nn.Module):
    """The naive baseline's sparse arch: one `nn.EmbeddingBag` (sparse gradients) per table."""

    def __init__(self, sizes: list[int], dim: int, device: torch.device):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True, device=device) for n in sizes)
        for bag, n in zip(self.bags, sizes):
            nn.init.uniform_(bag.weight, -n ** -0.5, n ** -0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(ids[:, i:i + 1]) for i, bag in enumerate(self.bags)], dim=1)  # [B, 26, D]


def build_path(name: str, args, sizes: list[int], device: torch.device, optim: tuple):
    """(model, step function) for the path `name` (module doc)."""
    kind, options = split_path(name)
    arch = (SMALL_ARCH if args.small else ARCH)[args.model]
    if kind == "loop":
        return build_loop_path(args, arch, sizes, device, optim, options)
    if kind == "plain":
        model = build_model(args.model, Features.categorical(sizes, 13), args.dim, **arch).to(device)
        tables = [p for p in model.embeddings.weights.values()]
    else:
        # tiny tables: the dense layers come out the same, and no 96 GB is drawn on the host
        model = build_model(args.model, Features.categorical([1] * len(SPARSE), 13), args.dim, **arch)
        if kind == "naive":
            model.embeddings = NaiveBags(sizes, args.dim, device)
            tables = list(model.embeddings.parameters())
        else:
            scope = {"fused-compile": "parts", "fused-compile-head": "head"}.get(kind, "")
            make_fast(model, args, sizes, device, optim, compile_scope=scope, options=options)
            tables = []
        model.to(device)
    graphs = device.type == "cuda" and kind in GRAPHED
    fused_adam = device.type == "cuda" and kind not in ("plain", "naive") and "foreach" not in options
    opts = make_optimizers(model, tables, optim, naive=kind == "naive", capturable=graphs, fused=fused_adam)
    step = make_step(model, opts, device, autocast=kind != "plain" and device.type == "cuda")
    return model, (capture_step(step, device) if graphs else step)


def make_step(model: nn.Module, opts: list, device: torch.device, autocast: bool):
    """The eager training step (dense, ids, labels) -> loss: forward (bf16 autocast if `autocast`),
    binary cross-entropy, backward, every optimizer's step."""

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

    return step


def build_loop_path(args, arch: dict, sizes: list[int], device: torch.device, optim: tuple, options: set[str]):
    """(model, step) as `ctrflow train` builds them on one GPU: its run plan (`ctrflow.accel.plan.plan_run`)
    and build step, its optimizers and graphed step (tables drawn on the device, as the benchmark's other
    fused paths: `apply_fused` would first build 96 GB of plain tables on the host)."""
    if device.type != "cuda":
        raise ValueError("the loop path needs CUDA")
    model = build_model(args.model, Features.categorical([1] * len(SPARSE), 13), args.dim, **arch)
    model.embeddings = fast_tables(args, sizes, device, optim, options)
    sparse = {"rowwise_adagrad": "adagrad", "adam": "lazy_adam"}.get(optim[2], optim[2])
    cfg = OptimConfig(dense="adam", lr=optim[1] if optim[0] == "adam" else 1e-3, sparse=sparse, sparse_lr=optim[3],
                      embedding_l2=getattr(args, "embedding_l2", 0.0))
    config = TrainConfig(model=ModelConfig(name=args.model, embedding_dim=args.dim), optim=cfg, embedding="fused",
                         precision="fp8" if options & FP8 else "auto", compile="off" if "nocompile" in options else "auto")
    runtime = Runtime(0, 1, device.index or 0, device)
    plan = plan_run(config, runtime, model)
    align = plan.align_linear and "noalign" not in options and not args.no_align
    plan = replace(plan, fp8=fp8_plan(args, options), align_linear=align, compile_mode=args.compile_mode)
    built = accelerate(model, plan, runtime)
    optimizers = build_optimizers(model, cfg, FusedTables(built.fused, sparse))
    if "foreach" in options:  # torch's multi-tensor Adam: one launch per group of tensors
        for group in optimizers.dense.param_groups:
            group["fused"] = None
    graphed = GraphedStep(train_step)

    def step(dense_x, ids, labels):
        optimizers.set_lr_factor(1.0)  # the loop sets the schedule's value before every step
        return graphed(model, Batch(dense_x, ids, labels), optimizers, device, torch.bfloat16)

    return model, step


def make_optimizers(model: nn.Module, tables: list, optim: tuple, naive: bool, capturable: bool,
                    fused: bool = False) -> list:
    """Dense optimizer over every parameter but `tables`, and the table optimizer over `tables`
    (none for the fused path, which updates its tables in backward). `fused`: torch's one-kernel
    Adam (one launch for all dense parameters instead of a few per group of tensors)."""
    table_ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    dense_opt, dense_lr, table_opt, table_lr = optim
    if dense_opt == "sgd":
        opts = [torch.optim.SGD(dense, lr=dense_lr)]
    else:
        opts = [torch.optim.Adam(dense, lr=dense_lr, capturable=capturable, fused=fused or None)]
    if naive:  # the naive baseline is SGD: optimizer state for 96 GB of tables would not fit
        opts.append(torch.optim.SGD(tables, lr=table_lr))
    elif tables:
        opts.append(TABLE_OPTIMIZERS[table_opt](tables, lr=table_lr))
    return opts


def fast_tables(args, sizes: list[int], device: torch.device, optim: tuple,
                options: set[str] = frozenset()) -> FusedEmbeddingCollection:
    """The fast paths' tables: one `FusedEmbeddingCollection` drawn on `device` (other numbers than the
    plain initialization, which would draw 96 GB on the host), lookups in bf16 on CUDA."""
    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # halves lookup + grad bytes
    storage = torch.bfloat16 if "bf16tab" in options else getattr(torch, args.storage)
    return FusedEmbeddingCollection(
        tables_for(Features.categorical(dict(zip(list(SPARSE), sizes))).sparse, args.dim), seed=0,
        optimizer=optim[2], lr=optim[3], device=device, output_dtype=out_dtype, storage_dtype=storage,
        check_ids=False, pre_reduce=not args.no_pre_reduce, l2=getattr(args, "embedding_l2", 0.0))


def fp8_plan(args, options: set[str]) -> Fp8Plan | None:
    """The fp8 options a path names (module doc), as `accelerate` takes them."""
    if not options & FP8:
        return None
    return Fp8Plan(min_features=16 if args.small else 512, rule="widening" if "fp8w" in options else "all",
                   grad_dtype="e4m3" if "e4m3g" in options else "e5m2", rowwise="fp8t" not in options,
                   fast_accum="fp32acc" not in options, fuse_cross="unfused" not in options,
                   absorb="noabsorb" not in options, wgrad_beside="beside" in options)


def make_fast(model: nn.Module, args, sizes: list[int], device: torch.device, optim: tuple,
              compile_scope: str, options: set[str] = frozenset()) -> None:
    """The fast path through `ctrflow.accel.accelerate.accelerate`, each rewrite computing the same function: fused
    tables (`fast_tables`), fused dot interaction, tensor-core-aligned Linear inputs, fp8 Linear layers if
    `options` ask, and optionally torch.compile'd dense parts (`compile_scope` "parts": each dense module
    apart; "head": the model's `head` method as one graph)."""
    model.embeddings = fast_tables(args, sizes, device, optim, options)
    plan = RunPlan(device=str(device), embedding="fused", autocast="bf16" if device.type == "cuda" else "fp32",
                   fp8=fp8_plan(args, options), align_linear=not args.no_align, compile=compile_scope or "off",
                   compile_mode=args.compile_mode)
    accelerate(model, plan, Runtime(0, 1, device.index or 0, device))


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
