"""`ctrflow train`: train a ranking model on processed data; checkpoints and metrics.jsonl in --out.

Runs alone (one process, CPU or one GPU) or under `torchrun --nproc-per-node N -m ctrflow train`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from ctrflow.config import MODELS, DataConfig, ModelConfig, OptimConfig, TrainConfig
from ctrflow.tracking import NullTracker, add_tracking_flags, tracker_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow train`."""
    d, m, o, t = DataConfig(), ModelConfig(), OptimConfig(), TrainConfig()
    parser.add_argument("--data", required=True, help="processed data directory (ctrflow preprocess --out)")
    parser.add_argument("--model", choices=MODELS, default=m.name)
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--epochs", type=int, default=t.epochs)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps in all")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (split across processes)")
    parser.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    parser.add_argument("--loader", choices=("auto", "memory", "stream"), default=d.loader,
                        help="train split: memory (read whole; on the GPU when it takes <= 1/16 of its memory) or "
                             "stream (row groups through shuffle windows, bounded memory); auto: memory when it fits")
    parser.add_argument("--shuffle-window", type=int, default=d.shuffle_window, metavar="ROWS",
                        help="--loader stream: rows shuffled together (2 x 160 B each in host and in GPU memory)")
    parser.add_argument("--lanes", type=int, default=d.lanes,
                        help="--loader stream: row streams per global batch; the batches are the same for any "
                             "process count dividing it")
    parser.add_argument("--loader-threads", type=int, default=None,
                        help="--loader stream: Parquet decode threads per process (default: cores / processes, <= 16)")
    parser.add_argument("--embedding-dim", type=int, default=m.embedding_dim)
    parser.add_argument("--lr", type=float, default=o.lr, help="dense learning rate")
    parser.add_argument("--sparse-lr", type=float, default=o.sparse_lr, help="embedding learning rate")
    parser.add_argument("--dense-optimizer", choices=("adam", "adamw", "sgd"), default=o.dense)
    parser.add_argument("--sparse-optimizer", choices=("auto", "sgd", "adagrad", "adam", "lazy_adam"), default=o.sparse,
                        help="embedding optimizer (auto: lazy_adam on tables of --large-table-rows or more, "
                             "adam below)")
    parser.add_argument("--large-table-rows", type=int, default=o.large_table_rows)
    parser.add_argument("--sharding", choices=("auto", "table", "row", "column", "data"), default=t.sharding,
                        help="how N processes split the embedding tables (auto: planned from sizes and memory)")
    parser.add_argument("--plan", default=None, metavar="FILE", help="JSON sharding plan: per-table choices")
    parser.add_argument("--warmup-steps", type=int, default=o.warmup_steps)
    parser.add_argument("--decay-start-step", type=int, default=o.decay_start_step,
                        help="polynomial LR decay from this step to the end (default: no decay)")
    parser.add_argument("--seed", type=int, default=t.seed)
    parser.add_argument("--log-every", type=int, default=t.log_every, help="steps between metrics.jsonl records")
    parser.add_argument("--eval-every", type=int, default=t.eval_every,
                        help="steps between validation AUCs (0: at each epoch's end)")
    parser.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every,
                        help="steps between checkpoints (0: at each epoch's end)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=t.device)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's choice; 1 is fastest on a busy machine)")
    parser.add_argument("--resume", default=None, metavar="CKPT", help="continue from a checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="--out holds a run: remove its checkpoints, latest and metrics.jsonl and start over")
    parser.add_argument("--limit-train-batches", type=int, default=None, help="batches per epoch (smoke runs)")
    parser.add_argument("--limit-eval-batches", type=int, default=None)
    parser.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower)")
    parser.add_argument("--embedding", choices=("auto", "fused", "plain"), default=t.embedding,
                        help="tables: fused (Triton kernels, optimizer step in backward; auto: on CUDA, under torchrun "
                             "each rank's shards unless a table is column-wise) or plain PyTorch")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp8"), default=t.precision,
                        help="dense part (auto: bf16 autocast on CUDA, fp32 on the CPU; fp8: bf16 autocast "
                             "and the Linear layers >= 512 wide in fp8, CUDA compute capability 8.9+)")
    parser.add_argument("--cuda-graphs", choices=("auto", "off"), default=t.cuda_graphs,
                        help="auto: one CUDA process with fused tables replays each step as one CUDA graph")
    parser.add_argument("--compile", choices=("auto", "off"), default=t.compile,
                        help="auto: torch.compile the dense layers on CUDA with fused tables (one process, "
                             "or torchrun's graphed step)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tracking_flags(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the flags describe (defaults from the dataclasses)."""
    base = TrainConfig()
    return dataclasses.replace(
        base,
        out=args.out,
        data=dataclasses.replace(base.data, path=args.data, batch_size=args.batch_size,
                                 eval_batch_size=args.eval_batch_size, limit_train_batches=args.limit_train_batches,
                                 limit_eval_batches=args.limit_eval_batches, loader=args.loader,
                                 shuffle_window=args.shuffle_window, lanes=args.lanes,
                                 loader_threads=args.loader_threads),
        model=dataclasses.replace(base.model, name=args.model, embedding_dim=args.embedding_dim),
        optim=dataclasses.replace(base.optim, dense=args.dense_optimizer, lr=args.lr, sparse_lr=args.sparse_lr,
                                  sparse=args.sparse_optimizer, large_table_rows=args.large_table_rows,
                                  warmup_steps=args.warmup_steps, decay_start_step=args.decay_start_step),
        epochs=args.epochs, max_steps=args.max_steps, seed=args.seed, log_every=args.log_every,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, device=args.device, threads=args.threads,
        resume=args.resume, overwrite=args.overwrite, deterministic=args.deterministic, progress=not args.no_progress,
        sharding=args.sharding, plan=args.plan, embedding=args.embedding, precision=args.precision,
        cuda_graphs=args.cuda_graphs, compile=args.compile,
    )


def run(args: argparse.Namespace) -> int:
    """Train; prints the final validation AUC and the checkpoint path."""
    from ctrflow.train.loop import train  # torch is imported only when training runs

    config = config_from_args(args)
    # under torchrun only rank 0 opens a tracking run
    tracker = tracker_from_args(args, "train") if int(os.environ.get("RANK", 0)) == 0 else NullTracker()
    with tracker:
        train(config, tracker)
    return 0
