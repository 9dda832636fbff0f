"""The training loop: one code path for one process (CPU or GPU) and, under torchrun, N.

Order of a run: runtime -> data -> model -> run plan and acceleration (`ctrflow.accel`: every choice
resolved, every rewrite applied) -> optimizers -> (resume, or warm start: `ctrflow.train.warm_start`)
-> steps, with
reports every `log_every` steps, validation every `eval_every` and at each epoch's end,
checkpoints every `checkpoint_every` and at each epoch's end. The loop's own state is three
integers: step, epoch and the next batch index within the epoch.
"""

from __future__ import annotations

import json
import random
from functools import partial
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ctrflow.config import TrainConfig
from ctrflow.loaders.batch import Batch
from ctrflow.loaders.memory import BatchLoader, ParquetDataset
from ctrflow.contract.schema import Schema
from ctrflow.loaders.scan import ScanLoader
from ctrflow.loaders.stream import StreamLoader, choose_loader
from ctrflow.loaders.stream_plan import ParquetIndex
from ctrflow.embedding.collection import deferred_tables
from ctrflow.embedding.optimizers import sparse_memory
from ctrflow.embedding.fused import FusedEmbeddingCollection
from ctrflow.embedding.fused.sharded import FusedShardedEmbeddingCollection
from ctrflow.accel.exchange import forward_in_chunks
from ctrflow.errors import UserError
from ctrflow.models import build_model
from ctrflow.tracking import NullTracker, Tracker
from ctrflow.tune.report import Reporter
from ctrflow import checkpoint
from ctrflow.train.best import BestCheckpoint
from ctrflow.train.calibration import calibrated, restore_trained_bias
from ctrflow.accel.accelerate import Built, accelerate
from ctrflow.accel.plan import RunPlan, plan_run, run_record, tracked_params
from ctrflow.accel.dense_average import DenseAverage
from ctrflow.runtime import Runtime, close_runtime, init_runtime, print0
from ctrflow.accel.fused import FusedTables
from ctrflow.accel.graphs import GraphedStep
from ctrflow.train.interrupt import StopSignals, checkpoint_stopped
from ctrflow.train.out_folder import claim_out
from ctrflow.train.optim import Optimizers, build_optimizers, lr_factor
from ctrflow.train.progress import ProgressLog, restart_metrics
from ctrflow.train.validate import validate
from ctrflow.train.warm_start import warm_start


@dataclass
class Session:
    """Everything a running training holds; `step`, `epoch`, `batch` are its position."""

    config: TrainConfig
    runtime: Runtime
    tracker: Tracker
    schema: Schema
    model: nn.Module  # after parallelize: this process's shards, dense parts under DDP when N > 1 (or `average`)
    optimizers: Optimizers
    train_loader: BatchLoader | StreamLoader
    valid_loader: ScanLoader | None
    out: Path
    total_steps: int
    plan: RunPlan = RunPlan()  # every choice of the run, resolved
    average: DenseAverage | None = None  # N processes, graphed step: the step averages the dense gradients
    reporter: Reporter = Reporter()  # tuning services' metrics (`--report-metrics`), main process only
    best: BestCheckpoint = field(default_factory=BestCheckpoint)  # best validation so far, early stopping
    # the calibration of a resumed checkpoint with nothing left to train (its weights are saved again as read)
    calibration: dict | None = None
    step: int = 0
    epoch: int = 0
    batch: int = 0

    @property
    def amp(self) -> torch.dtype | None:
        """Autocast dtype of the forward pass (None: fp32)."""
        return self.plan.amp


def train(config: TrainConfig, tracker: Tracker | None = None, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train `config.model` on processed data `config.data.path`, writing checkpoints and
    `metrics.jsonl` under `config.out`; returns a summary (steps, loss, valid auc, ...). `reporter`
    receives each validation's metrics (`ctrflow.tune.report`)."""
    tracker = tracker or NullTracker()
    with StopSignals() as stop:  # Ctrl-C / SIGTERM: a checkpoint at the step in flight, then a one-line exit
        runtime = init_runtime(config.device)
        try:
            session = _setup(config, tracker, runtime)
            session.reporter = reporter if reporter is not None and runtime.is_main else Reporter()
            return _fit(session, stop)
        finally:
            close_runtime(runtime)


def _setup(config: TrainConfig, tracker: Tracker, runtime: Runtime) -> Session:
    for flag, count in (("--threads", config.threads), ("--max-steps", config.max_steps), ("--epochs", config.epochs)):
        if count is not None and count < 0:
            raise UserError(f"{flag} must not be negative, got {count}")
    claim_out(config, runtime.is_main)  # before any work: a run already in --out needs --resume or --overwrite
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(config.seed)
    np.random.seed(config.seed)
    random.seed(config.seed)
    schema = Schema.load(config.data.path)
    # the batch the split's size gives (`DataConfig.batch_for`), recorded as given in config.json and the run plan
    config = replace(config, data=replace(config.data, batch_size=config.data.batch_for(schema.rows["train"])))
    train_loader, valid_loader, loader = _loaders(config, schema, runtime)
    optimizers, plan, built = _build(config, runtime, schema, loader)
    epoch_steps = len(train_loader)
    total = config.epochs * epoch_steps
    total = total if config.max_steps is None else min(config.max_steps, total)
    out = Path(config.out)
    session = Session(config, runtime, tracker, schema, built.model, optimizers,
                      train_loader, valid_loader, out, total, plan, built.average)
    source = _resume(session) if config.resume else None
    if config.init_from and not config.resume:
        step_dir = warm_start(built.model, optimizers, config, schema, runtime)
        print0(f"ctrflow train: warm start from {step_dir} (tables grown to this data's vocabularies)")
    if runtime.is_main:
        out.mkdir(parents=True, exist_ok=True)
        schema.save(out / "schema.json")
        (out / "config.json").write_text(json.dumps(run_record(config, plan), indent=2) + "\n")
        restart_metrics(out, source, session.step)
        tracker.log_params(tracked_params(config, plan))  # the resolved choices, never "auto"
        tracker.log_artifact(out / "config.json")
        tracker.set_tags({"schema.vocab_hash": schema.vocab_hash, "model": config.model.name})
    session.best = BestCheckpoint.start(out, config.early_stopping, bool(config.resume), runtime.is_main)
    _announce(session, built)
    return session


def _build(config: TrainConfig, runtime: Runtime, schema: Schema, loader: str) -> tuple[Optimizers, RunPlan, Built]:
    """(optimizers, plan, built): the model built from the schema, its choices resolved and applied
    (`ctrflow.accel`: fused tables, sharding, fp8, compile, ...), and its optimizers."""
    m = config.model
    # tables are drawn where they land: into the fused buffer on the device, or shard by shard (MLPerf's ~96 GB)
    with deferred_tables():
        model = build_model(m.name, schema, m.embedding_dim, seed=config.seed,
                            embedding_init_scale=m.embedding_init_scale, **m.arch_kwargs())
    if schema.label_rate is not None and not (config.resume or config.init_from):  # fresh: the click rate
        model.set_output_bias(schema.label_rate)
    plan = plan_run(config, runtime, model, loader)
    if plan.cpu_threads:
        torch.set_num_threads(plan.cpu_threads)
    built = accelerate(model, plan, runtime)
    plan = replace(plan, exchange_in_place=built.changes["exchange_in_place"])  # what build could apply
    tables = FusedTables(built.fused, config.optim.sparse) if plan.embedding == "fused" else None
    return build_optimizers(built.model, plan.optim, tables), plan, built


def _announce(s: Session, built: Built) -> None:
    """The run's description, printed once (main process): sizes, then every choice of the plan."""
    dense_params = sum(p.numel() for p in s.optimizers.dense.param_groups[0]["params"])
    print0(f"ctrflow train: {s.config.model.name}, {dense_params:,} dense parameters, "
           f"{sum(s.schema.table_sizes()):,} embedding rows x {s.config.model.embedding_dim}; "
           f"{len(s.train_loader.dataset):,} train rows, {len(s.train_loader)} steps/epoch of "
           f"{s.config.data.batch_size}")
    changes = built.changes
    done = [f"{changes['fp8_layers']} fp8 Linear" if changes["fp8_layers"] else "",
            f"{changes['aligned_layers']} aligned Linear" if changes["aligned_layers"] else ""]
    rows = {**s.plan.record(), "rewritten layers": ", ".join(filter(None, done)) or "none"}
    lines = [f"  {key:<24} {value}" for key, value in rows.items()]
    if s.plan.sharding is not None:
        from ctrflow.accel.parallelize import model_tables

        lines += ["  sharding plan:", s.plan.sharding.describe(model_tables(s.model), sparse_memory(s.config.optim))]
    print0("ctrflow train: run plan\n" + "\n".join(lines))


def _loaders(config: TrainConfig, schema: Schema,
             runtime: Runtime) -> tuple[BatchLoader | StreamLoader, ScanLoader | None, str]:
    """(train loader, valid loader or None, how the train split is read: "memory on DEVICE" | "stream (...)")."""
    data, sizes = config.data, schema.table_sizes()
    common = {"rank": runtime.rank, "world_size": runtime.world_size, "prefetch": data.prefetch,
              "pin_memory": runtime.device.type == "cuda"}
    train_loader, loader = _train_loader(config, sizes, runtime, common)
    if len(train_loader) == 0:
        raise UserError(f"{data.path}/train: {len(train_loader.dataset)} rows, fewer than one batch of "
                        f"{data.batch_size}")
    valid_loader = None
    if (Path(data.path) / "valid").is_dir():  # streamed in order: each process reads only its share
        valid_loader = ScanLoader(ParquetIndex(data.path, "valid"), data.eval_batch_size, rank=runtime.rank,
                                  world_size=runtime.world_size, table_sizes=sizes, device=runtime.device,
                                  threads=data.loader_threads, limit_batches=data.limit_eval_batches)
    return train_loader, valid_loader, loader


def _train_loader(config: TrainConfig, sizes: list[int], runtime: Runtime,
                  common: dict) -> tuple[BatchLoader | StreamLoader, str]:
    """In memory (whole split read) or streamed (`ctrflow.loaders.stream`), as `--loader` and the split's
    size say; with its description for the run plan."""
    data = config.data
    index = ParquetIndex(data.path, "train")  # footers only
    if choose_loader(data.loader, index.resident_bytes(), runtime.device) == "stream":
        loader = StreamLoader(index, data.batch_size, seed=config.seed, shuffle=data.shuffle, rank=runtime.rank,
                              world_size=runtime.world_size, lanes=data.lanes, window_rows=data.shuffle_window,
                              table_sizes=sizes, device=runtime.device, threads=data.loader_threads,
                              limit_batches=data.limit_train_batches, epochs=config.epochs)
        return loader, (f"stream ({index.resident_bytes() / 2**30:.1f} GiB: {data.lanes} lanes, shuffle window "
                        f"{data.shuffle_window:,} rows, {loader.buffer_bytes() / 2**30:.2f} GiB of buffers per "
                        f"process on host and device)")
    train_set = ParquetDataset(data.path, "train", sizes)
    device = _resident_device(train_set, runtime)
    loader = BatchLoader(train_set, data.batch_size, shuffle=data.shuffle, drop_last=True, seed=config.seed,
                         limit_batches=data.limit_train_batches, device=device, **common)
    return loader, f"memory on {device or 'cpu'}"


def _resident_device(dataset: ParquetDataset, runtime: Runtime) -> torch.device | None:
    """The GPU when the split takes at most 1/16 of its memory (the tables need the rest), else
    None: batches are then gathered on the host and copied."""
    if runtime.device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(runtime.device).total_memory
    return runtime.device if dataset.resident_bytes() * 16 <= total else None


def _resume(s: Session) -> Path:
    """Restore weights, optimizer state, RNG and position; returns the old metrics.jsonl."""
    step_dir = checkpoint.resolve_checkpoint(s.config.resume, pick=checkpoint.LAST)
    checkpoint.check_schema(Schema.load(step_dir / "schema.json"), s.schema, f"{s.config.data.path}/schema.json")
    trained = checkpoint.read_meta(step_dir, verify=False)["model"]
    wanted = checkpoint.model_meta(s.config)
    diffs = [f"{k} {trained.get(k)} != {wanted[k]}" for k in wanted if trained.get(k) != wanted[k]]
    if diffs:
        raise UserError(f"--resume {s.config.resume}: the checkpoint's model differs: " + "; ".join(diffs))
    meta = checkpoint.restore_checkpoint(step_dir, s.model, s.optimizers, runtime=s.runtime)
    if s.step < s.total_steps:  # training continues from its own bias, not the calibrated one the checkpoint holds
        restore_trained_bias(s.model, meta)
    else:
        s.calibration = meta.get("calibration")
    s.step, s.epoch, s.batch = meta["step"], meta["epoch"], meta["batch"]
    print0(f"ctrflow train: resumed from {step_dir} at step {s.step} (epoch {s.epoch}, batch {s.batch})")
    return step_dir.parent / "metrics.jsonl"


def _fit(s: Session, stop: StopSignals) -> dict[str, Any]:
    cfg = s.config
    log = ProgressLog(s.out, s.runtime, s.tracker, cfg.data.batch_size, s.total_steps, s.step, cfg.progress)
    done = {"eval": -1, "ckpt": -1}
    valid: dict[str, float] = {}
    step = partial(train_step, average=s.average) if s.average is not None else train_step
    step_fn = GraphedStep(step, host=_host_tables(s.model)) if s.plan.cuda_graphs else step
    stop.defer(s.runtime)  # from the first step on, a signal stops between steps
    try:
        while s.step < s.total_steps and s.epoch < cfg.epochs and not s.best.stop:
            batches = s.train_loader.batches(s.epoch, start=s.batch)
            for batch in _moved_ahead(batches, _host_tables(s.model), s.runtime.device):
                s.optimizers.set_lr_factor(lr_factor(s.step, cfg.optim, s.total_steps, len(s.train_loader)))
                log.add(step_fn(s.model, batch, s.optimizers, s.runtime.device, s.amp))
                s.step, s.batch = s.step + 1, s.batch + 1
                epoch_end = s.batch == len(s.train_loader)
                if epoch_end:
                    s.epoch, s.batch = s.epoch + 1, 0
                last = epoch_end or s.step >= s.total_steps
                valid = _periodic(s, log, done, last) or valid
                if s.step >= s.total_steps or s.best.stop:
                    break
                if (signum := stop.requested(s.step)) is not None:
                    raise checkpoint_stopped(s, log, done, signum)
    finally:
        log.close()
        if isinstance(step_fn, GraphedStep):
            step_fn.release()  # before the process group goes: NCCL waits for graphs holding its calls
    return _finish(s, log, valid, done)


def _host_tables(model: nn.Module) -> FusedEmbeddingCollection | None:
    """The model's fused collection where it keeps tables in host memory (None: no such collection)."""
    coll = getattr(model, "embeddings", None)
    return coll if isinstance(coll, FusedEmbeddingCollection) and coll.host is not None else None


def _moved_ahead(batches, coll: FusedEmbeddingCollection | None, device: torch.device):
    """The batches; where fused tables live in host memory (`coll`), each moved to the device one step
    early and its rows prefetched then, so the next batch's rows move while this step runs (the
    current batch's first where none is queued: the first step, or one after an evaluation;
    `ctrflow.embedding.fused.cached`)."""
    if coll is None:
        yield from batches
        return
    moved = (batch.to(device, non_blocking=True) for batch in batches)
    current = next(moved, None)
    while current is not None:
        following = next(moved, None)
        if following is not None:
            if not coll.host.queued:
                coll.prefetch(current.sparse)
            coll.prefetch(following.sparse)
        yield current
        current = following


def train_step(model: nn.Module, batch: Batch, optimizers: Optimizers, device: torch.device,
               amp: torch.dtype | None = None, average: DenseAverage | None = None,
               next_ids: torch.Tensor | None = None, chunks: int = 1) -> torch.Tensor:
    """Forward (under `amp` autocast if given), BCE-with-logits loss in fp32, backward, update
    (fused tables update inside backward, or, with `average`, after its all-reduce of the dense
    gradients has started); returns the (device) loss, unsynced. Fused sharded tables: `next_ids`
    (the next step's ids [B, F]) routes them during this step, `chunks` micro-batches
    (`forward_in_chunks`)."""
    batch = batch.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        if isinstance(model.embeddings, FusedShardedEmbeddingCollection):  # exchanges start first
            logits = forward_in_chunks(model, batch.dense, batch.sparse, chunks, next_ids)
        else:
            logits = model(batch.dense, batch.sparse)
    loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
    optimizers.zero_grad()
    loss.backward()
    if average is not None:
        average.reduce()  # dense all-reduce started, tables' update beside it, averages in .grad
    optimizers.step()
    return loss.detach()


def _periodic(s: Session, log: ProgressLog, done: dict[str, int], last: bool) -> dict[str, float] | None:
    """Report, validate and checkpoint when their turn (or the epoch's or run's end) comes."""
    cfg, step = s.config, s.step
    lr = s.optimizers.base_lrs[0] * lr_factor(step - 1, cfg.optim, s.total_steps, len(s.train_loader))
    evaluate = s.valid_loader is not None and (last or (cfg.eval_every and step % cfg.eval_every == 0))
    save = last or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
    valid, best = None, False
    if evaluate:
        log.pause()
        valid = validate(s.model, s.valid_loader, s.runtime, s.amp)
        log.resume()
        done["eval"] = step
        best = s.best.offer(step, valid["auc"])  # the best is written now, whatever checkpoint_every says
        save = save or best or s.best.stop
        print0(f"step {step}: valid auc {valid['auc']:.4f} logloss {valid['logloss']:.4f} "
               f"mean prediction / click rate {valid['calibration_ratio']:.3f}{s.best.note(best)}")
        s.reporter.report(step, s.epoch, valid)
    if evaluate or (cfg.log_every and step % cfg.log_every == 0):
        log.report(step, lr, {"auc": valid["auc"], "valid_logloss": valid["logloss"]} if valid else None)
    if save:
        log.check_finite(step)  # never checkpoint weights a NaN has reached
        log.pause()
        with calibrated(s.model, valid, cfg.calibrate) as record:  # the bias the validation fitted, saved
            checkpoint.save_checkpoint(s.out, s.model, s.optimizers, {"step": step, "epoch": s.epoch, "batch": s.batch},
                                       cfg, s.schema, s.runtime, metrics=valid or {},
                                       run={**run_record(cfg, s.plan), "calibration": record}, best=best)
        log.resume()
        done["ckpt"] = step
    return valid


def _finish(s: Session, log: ProgressLog, valid: dict[str, float], done: dict[str, int]) -> dict[str, Any]:
    if done["ckpt"] != s.step:  # resumed at the very end: nothing trained, but `out` is still a checkpoint
        if s.valid_loader is not None:
            valid = validate(s.model, s.valid_loader, s.runtime, s.amp)
            s.reporter.report(s.step, s.epoch, valid)
        # nothing trained (a resumed run at its end, a warm start of 0 steps): the weights as they were read
        checkpoint.save_checkpoint(s.out, s.model, s.optimizers, {"step": s.step, "epoch": s.epoch, "batch": s.batch},
                                   s.config, s.schema, s.runtime, metrics=valid,
                                   run={**run_record(s.config, s.plan), "calibration": s.calibration})
        done["ckpt"] = s.step
    summary = {"step": s.step, "epoch": s.epoch, "loss": log.last.get("loss"),
               "samples_per_s": log.throughput(s.step), "checkpoint": str(s.out / f"step_{done['ckpt']:08d}"),
               **{f"valid_{k}": v for k, v in valid.items()}, **s.best.summary(s.out),
               "early_stopped": s.best.stop}
    hit_rate = s.model.embeddings.cache_hit_rate() if hasattr(s.model.embeddings, "cache_hit_rate") else None
    if hit_rate is not None:  # tables in host memory: the share of each batch's distinct rows found cached
        summary["cache_hit_rate"] = hit_rate
    if s.runtime.is_main:
        (s.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        s.tracker.log_metrics({k: v for k, v in summary.items() if isinstance(v, float)}, step=s.step)
        if "best_step" in summary:
            s.tracker.log_metrics({"best_step": float(summary["best_step"])}, step=s.step)
            s.tracker.set_tags({"best_checkpoint": summary["best_checkpoint"], "best_step": str(summary["best_step"])})
        s.tracker.log_artifact(s.out / "metrics.jsonl")
    best = (f", best valid auc {summary['best_valid_auc']:.4f} at step {summary['best_step']} "
            f"({summary['best_checkpoint']}: evaluate/export/predict read it)" if "best_step" in summary else "")
    print0(f"ctrflow train: {s.step} steps{' (early stopping)' if s.best.stop else ''}, loss {summary['loss']}, "
           f"valid auc {valid.get('auc')}, checkpoint {summary['checkpoint']}{best}")
    return summary
