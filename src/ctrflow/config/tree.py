"""The run's config tree: frozen dataclasses, `TrainConfig` over `DataConfig`, `ModelConfig` and `OptimConfig`.

It round-trips through `to_dict` / `from_dict`, which is how checkpoints record it and trackers log
it. The `model` section is flat: `name`, the settings every model takes (`ModelConfig`'s fields) and
the settings of the model `name` names, which that model's file declares and registers
(`ctrflow.models.spec`). `CHOICES` and `choices_of` list the values a field may take where they are few.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ctrflow.models import MODELS, spec_of
from ctrflow.models.spec import setting_types


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one ranking model: the settings every model takes, and in `arch` the settings
    of model `name` (its registered settings class; None: that class's defaults)."""

    name: str = "dlrm"
    embedding_dim: int = 16
    arch: Any = None
    dropout: float = 0.0  # share of each hidden activation of the over arch / deep MLP dropped while training
    # the tables are drawn by DLRM's rule, uniform(+-1/sqrt(rows)), then multiplied by this: the full
    # draw gives a 5-row table rows of norm 1 and DeepFM a first logit spread of ~1 before any step
    # (benchmarks/quality.md); 1.0 is the MLPerf reference's init
    embedding_init_scale: float = 0.1

    def __post_init__(self):
        spec = spec_of(self.name)
        if self.arch is None:
            object.__setattr__(self, "arch", spec.config())
        elif not isinstance(self.arch, spec.config):
            raise TypeError(f"model {self.name!r} takes {spec.config.__name__} settings, got {self.arch!r}")

    def arch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments `build_model(self.name, ...)` takes for this architecture (what a
        checkpoint's `meta.json` records): the model's own settings and `dropout`."""
        own = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.arch).items()}
        return {**own, "dropout": self.dropout}

    def to_dict(self) -> dict[str, Any]:
        """The flat `model` section: `name`, `embedding_dim`, the model's own settings, the rest."""
        common = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "arch"}
        return {"name": self.name, "embedding_dim": self.embedding_dim, **asdict(self.arch), **common}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """The config of a flat `model` section. Keys of other models' settings are passed over:
        files written before models owned their settings list every model's fields, and a file may
        hold settings for a model chosen later (`--model`); unknown keys (newer versions) likewise."""
        raw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items()}
        spec = spec_of(raw.get("name", cls.name))
        own = {f.name for f in fields(spec.config)}
        common = {f.name for f in fields(cls)} - {"arch"}
        return cls(arch=spec.config(**{k: v for k, v in raw.items() if k in own}),
                   **{k: v for k, v in raw.items() if k in common})

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """`{key: type hint}` of the flat section: the common fields and every registered model's settings."""
        hints = typing.get_type_hints(cls)
        return {**{f.name: hints[f.name] for f in fields(cls) if f.name != "arch"}, **setting_types()}


@dataclass(frozen=True)
class OptimConfig:
    """Dense and sparse optimizers and the DLRM learning-rate schedule."""

    dense: str = "adam"  # adam | adamw | sgd
    lr: float = 1e-3
    sparse: str = "auto"  # embedding tables: auto (lazy_adam on large, adam on small) | sgd | adagrad | adam | lazy_adam
    # auto: tables of at least this many rows get lazy_adam (only touched rows move), smaller ones
    # dense adam, whose O(rows) step costs no more than a batch of lookups there
    large_table_rows: int = 1_000
    # None: same as lr. 10x the dense rate made the embeddings memorize the train split in the second
    # epoch (DeepFM lost 0.04 AUC: benchmarks/quality.md)
    sparse_lr: float | None = None
    # L2 on the embedding rows a batch touches: each distinct row's summed gradient gets + embedding_l2 * w
    # before the optimizer's rule (per step, against the mean loss; untouched rows are left alone)
    embedding_l2: float = 1e-2
    weight_decay: float = 0.0  # dense only
    warmup_steps: int = 0  # linear warmup from 0
    # polynomial decay to min_lr_factor at the run's last step, from the end of this epoch: the first
    # epoch at the full rate, every later one decaying (a one-epoch run never decays). At a constant
    # rate the second epoch lost up to 0.004 AUC on movielens-like (benchmarks/quality.md). None: no decay
    decay_start_epoch: int | None = 1
    decay_start_step: int | None = None  # polynomial decay from this step instead (None: decay_start_epoch)
    decay_steps: int = 0  # steps to decay over (0: until the run's last step)
    decay_power: float = 2.0
    min_lr_factor: float = 0.0  # the factor the decay ends at


AUTO_BATCH = 2048  # the batch of a train split of at least MIN_EPOCH_STEPS * 2048 rows (131,072)
MIN_AUTO_BATCH = 256  # divisible by the stream loader's lanes, and still a batch of many rows
MIN_EPOCH_STEPS = 64


@dataclass(frozen=True)
class DataConfig:
    """Where processed data lives and how it is batched."""

    path: str = ""
    # global: split across processes. None: `AUTO_BATCH`, halved (down to `MIN_AUTO_BATCH`) until an epoch
    # of the train split holds `MIN_EPOCH_STEPS` steps (`batch_for`): at 2048, 100,000 rows give 48 steps,
    # too few for a one-epoch run to learn (docs/steps.md)
    batch_size: int | None = None
    eval_batch_size: int = 16384
    shuffle: bool = True
    prefetch: int = 4  # batches prepared ahead by the loader thread
    # train split: auto (in memory when it fits: on the GPU within 1/16 of its memory, on the CPU
    # within 1/4 of host memory per process; else streamed) | memory | stream (ctrflow.loaders.stream)
    loader: str = "auto"
    shuffle_window: int = 1 << 23  # stream: rows shuffled together (all lanes); 2 x 160 B each on host and device
    lanes: int = 8  # stream: the same global batches for any process count dividing it
    loader_threads: int | None = None  # stream: decode threads per process (None: cores / local processes, <= 16)
    limit_train_batches: int | None = None  # per epoch, for smoke runs
    limit_eval_batches: int | None = None

    def batch_for(self, train_rows: int) -> int:
        """The global batch of a train split of `train_rows` rows: `batch_size` when given, else the
        largest of `AUTO_BATCH`, its halves down to `MIN_AUTO_BATCH`, that gives an epoch at least
        `MIN_EPOCH_STEPS` steps (the smallest when none does)."""
        if self.batch_size is not None:
            return self.batch_size
        batch = AUTO_BATCH
        while batch > MIN_AUTO_BATCH and train_rows // batch < MIN_EPOCH_STEPS:
            batch //= 2
        return batch


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; `out` is the checkpoint directory."""

    out: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    epochs: int = 1
    max_steps: int | None = None
    seed: int = 0
    log_every: int = 50
    eval_every: int = 0  # 0: evaluate at the end of each epoch only
    checkpoint_every: int = 0  # 0: checkpoint at the end of each epoch only
    keep_checkpoints: int = 2  # the newest step directories kept (besides the best, which is never pruned)
    early_stopping: int = 0  # stop after this many validations without a better AUC (0: never)
    # each checkpoint written after a validation holds the output bias that makes its mean prediction on
    # the valid split equal the observed click rate (ctrflow.train.calibration); False: the trained bias
    calibrate: bool = True
    device: str = "auto"  # auto | cpu | cuda
    # torch intra-op threads on the CPU; None: torch's default, 4 fewer beside fused tables in host memory
    threads: int | None = None
    resume: str | None = None
    # warm start: a checkpoint's weights and optimizer state, tables grown to this data's vocabularies
    # (`ctrflow.train.warm_start`); a fresh position and schedule. --resume wins when both are given.
    init_from: str | None = None
    overwrite: bool = False  # --out holds a run and resume is None: remove that run first (else refuse)
    sharding: str = "auto"  # with N processes: auto | table | row | column | data for every table
    plan: str | None = None  # JSON sharding plan file: per-table choices over `sharding`
    # per process: the device memory the tables may take (weights and optimizer state); the planner keeps
    # what fits on the device and the rest in host memory with a device cache of hot rows (None: all on
    # the device, refused where they do not fit; ctrflow.embedding.placement)
    embedding_memory_gib: float | None = None
    deterministic: bool = False
    embedding: str = "auto"  # auto (fused on CUDA, each rank's shards under torchrun) | fused | plain
    precision: str = "auto"  # dense part: auto (bf16 autocast on CUDA, fp32 elsewhere) | fp32 | bf16
    # | fp8 (bf16 autocast + the Linear layers >= 512 wide in fp8: CUDA compute capability 8.9+)
    cuda_graphs: str = "auto"  # auto (the step as one CUDA graph where capturable: ctrflow.accel.graphs) | off
    compile: str = "auto"  # auto (torch.compile the dense head, DCNv2, on CUDA with fused tables) | off
    progress: bool = True  # tqdm bar when stderr is a terminal

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON-ready)."""
        return {**asdict(self), "model": self.model.to_dict()}

    def flat(self) -> dict[str, Any]:
        """`{"model.name": "dlrm", ...}`: for trackers' params."""
        out: dict[str, Any] = {}
        for key, value in self.to_dict().items():
            if isinstance(value, dict):
                out.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainConfig":
        """Inverse of `to_dict`; unknown keys (from newer versions) are ignored."""
        parts = {"data": DataConfig, "optim": OptimConfig}
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in raw:
                continue
            value = raw[f.name]
            if f.name == "model":
                value = ModelConfig.from_dict(value)
            elif f.name in parts:
                value = _build(parts[f.name], value)
            kwargs[f.name] = value
        return cls(**kwargs)


def _build(cls, raw: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in known}
    return cls(**values)


# fields whose values are a few names: config files, flags and checks share these lists
CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "sharding": ("auto", "table", "row", "column", "data"),
    "embedding": ("auto", "fused", "plain"),
    "precision": ("auto", "fp32", "bf16", "fp8"),
    "cuda_graphs": ("auto", "off"),
    "compile": ("auto", "off"),
    "data.loader": ("auto", "memory", "stream"),
    "optim.dense": ("adam", "adamw", "sgd"),
    "optim.sparse": ("auto", "sgd", "adagrad", "adam", "lazy_adam"),
}


def choices_of(key: str) -> tuple[str, ...] | None:
    """The values dotted field `key` may take, where they are few (`model.name`: the registered models)."""
    return tuple(MODELS) if key == "model.name" else CHOICES.get(key)


def section_types(cls: type) -> dict[str, Any]:
    """`{field: type hint}` of a config section as files write it (the model section flat)."""
    if hasattr(cls, "field_types"):
        return cls.field_types()
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


__all__ = ["CHOICES", "DataConfig", "ModelConfig", "OptimConfig", "TrainConfig", "choices_of", "section_types"]
