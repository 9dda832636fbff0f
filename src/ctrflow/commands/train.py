"""`ctrflow train`: train a ranking model on processed data; checkpoints and metrics.jsonl in --out.

Runs alone (one process, CPU or one GPU) or under `torchrun --nproc-per-node N -m ctrflow train`.
The run is `--config FILE|PRESET` (optional) with the flags given on the command line over it; every
field of `ctrflow.config.TrainConfig` has a flag, each registered model's own settings included (a
flag per setting name, from `ctrflow.models`). `--print-config` prints the whole as YAML and exits
(with `--embedding-memory-gib` and `--data`, the tables' placement after it, as YAML comments).
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any

from ctrflow.config import TrainConfig, choices_of
from ctrflow.errors import UserError
from ctrflow.models.spec import setting_help, setting_types
from ctrflow.tracking import NullTracker, add_tracking_flags, tracker_from_args

NONE = "none"  # the value that sets an optional field to null from the command line


def widths(text: str) -> tuple[int, ...]:
    """`"512,256,128"` -> (512, 256, 128) (an MLP's hidden widths; "" for none)."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated widths like 512,256, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"widths must be positive, got {text!r}")
    return values


def optional(kind):
    """A flag type that also takes `none` (the field's null: e.g. no decay, torch's thread count)."""
    def parse(text: str):
        return NONE if text.lower() == NONE else kind(text)

    parse.__name__ = kind.__name__
    return parse


# (flag, config field, argparse options, help): every TrainConfig field but the models' own settings
# (`model_flags`, listed after --embedding-dim), the flags' one table
FLAGS: list[tuple[str, str, dict[str, Any], str]] = [
    ("--data", "data.path", {"metavar": "DIR"}, "processed data directory (ctrflow preprocess --out)"),
    ("--out", "out", {"metavar": "CKPT"}, "checkpoint directory to write"),
    ("--model", "model.name", {}, "ranking model"),
    ("--embedding-dim", "model.embedding_dim", {"type": int}, "embedding width"),
    ("--dropout", "model.dropout", {"type": float}, "share of each hidden activation of the over arch / deep MLP "
                                                    "dropped while training"),
    ("--embedding-init-scale", "model.embedding_init_scale", {"type": float},
     "the tables' uniform(+-1/sqrt(rows)) draw is multiplied by this (1: DLRM's reference init)"),
    ("--epochs", "epochs", {"type": int}, "passes over the train split"),
    ("--max-steps", "max_steps", {"type": optional(int)}, "stop after this many steps in all (none: the epochs)"),
    ("--batch-size", "data.batch_size", {"type": optional(int)},
     "global batch (split across processes); none: 2048, halved down to 256 until an epoch of the train split "
     "holds 64 steps"),
    ("--eval-batch-size", "data.eval_batch_size", {"type": int}, "validation batch"),
    ("--shuffle", "data.shuffle", {"action": argparse.BooleanOptionalAction}, "shuffle the train split each epoch"),
    ("--prefetch", "data.prefetch", {"type": int}, "batches prepared ahead by the loader thread"),
    ("--loader", "data.loader", {}, "train split: memory (read whole; on the GPU when it takes <= 1/16 of its "
                                    "memory) or stream (row groups through shuffle windows, bounded memory); "
                                    "auto: memory when it fits"),
    ("--shuffle-window", "data.shuffle_window", {"type": int, "metavar": "ROWS"},
     "--loader stream: rows shuffled together (2 x 160 B each in host and in GPU memory)"),
    ("--lanes", "data.lanes", {"type": int}, "--loader stream: row streams per global batch; the batches are the "
                                             "same for any process count dividing it"),
    ("--loader-threads", "data.loader_threads", {"type": optional(int)},
     "--loader stream: Parquet decode threads per process (none: cores / processes, <= 16)"),
    ("--limit-train-batches", "data.limit_train_batches", {"type": optional(int)}, "batches per epoch (smoke runs)"),
    ("--limit-eval-batches", "data.limit_eval_batches", {"type": optional(int)}, "validation batches"),
    ("--dense-optimizer", "optim.dense", {}, "optimizer of the dense layers"),
    ("--lr", "optim.lr", {"type": float}, "dense learning rate"),
    ("--weight-decay", "optim.weight_decay", {"type": float}, "dense weight decay"),
    ("--sparse-optimizer", "optim.sparse", {}, "embedding optimizer (auto: lazy_adam on tables of "
                                               "--large-table-rows or more, adam below; fused: lazy_adam)"),
    ("--sparse-lr", "optim.sparse_lr", {"type": optional(float)}, "embedding learning rate (none: --lr)"),
    ("--embedding-l2", "optim.embedding_l2", {"type": float},
     "L2 on the embedding rows each batch touches: + X * w on each touched row's gradient, every path (0: none)"),
    ("--large-table-rows", "optim.large_table_rows", {"type": int}, "--sparse-optimizer auto: lazy_adam from here"),
    ("--warmup-steps", "optim.warmup_steps", {"type": int}, "linear learning-rate warmup from 0"),
    ("--decay-start-epoch", "optim.decay_start_epoch", {"type": optional(int)},
     "polynomial learning-rate decay to the run's last step from the end of this epoch (none: no decay)"),
    ("--decay-start-step", "optim.decay_start_step", {"type": optional(int)},
     "polynomial learning-rate decay from this step instead (none: --decay-start-epoch)"),
    ("--decay-steps", "optim.decay_steps", {"type": int}, "steps the decay takes (0: until the run's last step)"),
    ("--decay-power", "optim.decay_power", {"type": float}, "the decay polynomial's power"),
    ("--min-lr-factor", "optim.min_lr_factor", {"type": float}, "the factor of the learning rate the decay ends at"),
    ("--seed", "seed", {"type": int}, "seed of the weights, the shuffle and dropout"),
    ("--log-every", "log_every", {"type": int}, "steps between metrics.jsonl records"),
    ("--eval-every", "eval_every", {"type": int}, "steps between validation AUCs (0: at each epoch's end)"),
    ("--checkpoint-every", "checkpoint_every", {"type": int}, "steps between checkpoints (0: at each epoch's end)"),
    ("--keep-checkpoints", "keep_checkpoints", {"type": int},
     "step directories kept (the newest; the best by validation AUC is kept besides)"),
    ("--early-stopping", "early_stopping", {"type": int},
     "stop after N validations without a better AUC (0: never); the best checkpoint is kept either way"),
    ("--calibrate", "calibrate", {"action": argparse.BooleanOptionalAction},
     "each checkpoint written after a validation holds the output bias that makes its mean prediction on the "
     "valid split equal the observed click rate (recorded in meta.json); --no-calibrate keeps the trained bias"),
    ("--resume", "resume", {"type": optional(str), "metavar": "CKPT"},
     "continue from a checkpoint (a run directory: its last step, not its best)"),
    ("--init-from", "init_from", {"type": optional(str), "metavar": "CKPT"},
     "warm start: begin from a checkpoint's weights and optimizer state, its tables grown to this data's "
     "vocabularies (preprocess --vocab-from), with a fresh step count and schedule (--resume wins)"),
    ("--overwrite", "overwrite", {"action": argparse.BooleanOptionalAction},
     "--out holds a run: remove its checkpoints, latest and metrics.jsonl and start over"),
    ("--device", "device", {}, "where to train (auto: a GPU when there is one)"),
    ("--threads", "threads", {"type": optional(int)},
     "CPU threads for torch (none: torch's choice, 4 fewer beside fused tables in host memory on a GPU; 1 is "
     "fastest on a busy machine)"),
    ("--sharding", "sharding", {}, "how N processes split the embedding tables (auto: planned from sizes and "
                                   "memory)"),
    ("--plan", "plan", {"type": optional(str), "metavar": "FILE"}, "JSON sharding plan: per-table choices"),
    ("--embedding-memory-gib", "embedding_memory_gib", {"type": optional(float), "metavar": "GIB"},
     "per process: device memory the tables may take with their optimizer state; the tables beyond it live "
     "in host memory with a device cache of their hot rows (none: all on the device)"),
    ("--embedding", "embedding", {}, "tables: fused (Triton kernels, optimizer step in backward; auto: on CUDA, "
                                     "under torchrun each rank's shards unless a table is column-wise) or plain "
                                     "PyTorch"),
    ("--precision", "precision", {}, "dense part (auto: bf16 autocast on CUDA, fp32 on the CPU; fp8: bf16 autocast "
                                     "and the Linear layers >= 512 wide in fp8, CUDA compute capability 8.9+)"),
    ("--cuda-graphs", "cuda_graphs", {}, "auto: a CUDA run with every table fused replays each step as one CUDA "
                                         "graph"),
    ("--compile", "compile", {}, "auto: torch.compile the dense layers on CUDA with fused tables (one process, "
                                 "or torchrun's graphed step)"),
    ("--deterministic", "deterministic", {"action": argparse.BooleanOptionalAction},
     "deterministic kernels (slower)"),
    ("--progress", "progress", {"action": argparse.BooleanOptionalAction}, "progress bar on a terminal"),
]


def model_flags() -> list[tuple[str, str, dict[str, Any], str]]:
    """A flag per registered model setting (`cross_rank` -> `--cross-rank`), typed by its field, its
    help naming the models that have it."""
    out = []
    for key, hint in setting_types().items():
        text, defaults = setting_help(key)
        out.append((f"--{key.replace('_', '-')}", f"model.{key}", flag_options(hint),
                    f"{', '.join(defaults)}: {text}"))
    return out


def flag_options(hint: Any) -> dict[str, Any]:
    """The argparse options of a field of type `hint` (widths, numbers, names, switches; `none` for null)."""
    union = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    kind = next((o for o in union if o is not type(None)), hint)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is tuple:
        return {"type": widths, "metavar": "W,W,..."}
    kind = kind if kind in (int, float) else str
    return {"type": optional(kind) if type(None) in union else kind}


def all_flags() -> list[tuple[str, str, dict[str, Any], str]]:
    """`FLAGS` with the models' own settings after --embedding-dim."""
    at = next(i for i, row in enumerate(FLAGS) if row[1] == "model.embedding_dim") + 1
    return [*FLAGS[:at], *model_flags(), *FLAGS[at:]]


def _default(key: str) -> Any:
    if key.startswith("model.") and key[6:] in setting_types():
        defaults = {model: _shown(value) for model, value in setting_help(key[6:])[1].items()}
        if len(set(map(str, defaults.values()))) == 1:
            return next(iter(defaults.values()))
        return "; ".join(f"{model} {value}" for model, value in defaults.items())
    value: Any = TrainConfig()
    for part in key.split("."):
        value = getattr(value, part)
    return _shown(value)


def _shown(value: Any) -> Any:
    return ",".join(map(str, value)) if isinstance(value, tuple) else value


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow train`: `--config`, `--print-config` and one flag per config field, each
    defaulting to None (not given) so that only the flags given override the file."""
    from ctrflow.config.files import preset_names

    parser.add_argument("--config", metavar="FILE|PRESET", default=None,
                        help="YAML or JSON file of config fields (flags override it), or a preset: "
                             + ", ".join(preset_names()))
    parser.add_argument("--print-config", action="store_true", help="print the whole config as YAML and exit")
    parser.add_argument("--report-metrics", action="append", metavar="vertex|katib|none", default=None,
                        help="also report each validation AUC to a tuning service: vertex (the cloudml-hypertune "
                             "metrics file), katib (stdout lines for its metrics collector); repeatable")
    for flag, key, options, text in all_flags():
        if choices_of(key):
            options = {"choices": choices_of(key), **options}
        if "type" in options and "metavar" not in options:
            options = {"metavar": {"int": "N", "float": "X"}.get(options["type"].__name__, "VALUE"), **options}
        default = _default(key)
        shown = "" if key in ("out", "data.path") else f" (default: {'none' if default is None else default})"
        parser.add_argument(flag, dest=key, default=None, help=text + shown, **options)
    add_tracking_flags(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of `--config` (or the defaults) with the flags given over it."""
    from ctrflow.config.files import load_config

    given = {key: getattr(args, key) for _flag, key, _options, _text in all_flags() if getattr(args, key) is not None}
    overrides = {key: None if value == NONE else value for key, value in given.items()}
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    """Train (or, with --print-config, print the config); prints the final validation AUC and the checkpoint."""
    config = config_from_args(args)
    if args.print_config:
        from ctrflow.config.files import to_yaml

        print(to_yaml(config), end="")
        if config.embedding_memory_gib is not None and config.data.path:  # where each table will live
            from ctrflow.accel.plan import describe_placement

            world = int(os.environ.get("WORLD_SIZE", 1))
            print(f"# the tables on {world} process(es) within --embedding-memory-gib {config.embedding_memory_gib}:")
            print("".join(f"# {line}\n" for line in describe_placement(config, world).splitlines()), end="")
        return 0
    missing = [flag for flag, key, value in (("--data", "data.path", config.data.path), ("--out", "out", config.out))
               if not value]
    if missing:
        raise UserError(f"{' and '.join(missing)} required (on the command line or in --config)")
    from ctrflow.train.loop import train  # torch is imported only when training runs
    from ctrflow.tune.report import reporters_for

    reporter = reporters_for(args.report_metrics)

    # under torchrun only rank 0 opens a tracking run
    tracker = tracker_from_args(args, "train") if int(os.environ.get("RANK", 0)) == 0 else NullTracker()
    with tracker:
        train(config, tracker, reporter)
    return 0
