"""Whole runs by name: the presets shipped as YAML in `presets/` (`--config NAME`), and the CPU-sized run."""

from __future__ import annotations

from ctrflow.config.files import load_config
from ctrflow.config.tree import DataConfig, ModelConfig, OptimConfig, TrainConfig


def small_config(data: str, out: str, model: str = "dlrm") -> TrainConfig:
    """CPU-sized defaults: 200,000 synthetic rows a day train one epoch in about a minute.

    # 200,000 rows / 2048 per step = 97 steps an epoch; decay over the second half.
    """
    return TrainConfig(
        out=out,
        data=DataConfig(path=data, batch_size=2048),
        model=ModelConfig(name=model, embedding_dim=16),
        optim=OptimConfig(lr=1e-3),
    )


def criteo_1tb_config(data: str, out: str, model: str = "dlrm") -> TrainConfig:
    """The MLPerf Criteo-1TB DLRM shape (the `mlperf-dlrm` preset: dim 128, bottom 13-512-256-128,
    top 1024-1024-512-256-1) on `data`, written to `out`, as `model` (its settings from the preset)."""
    return load_config("mlperf-dlrm", {"out": out, "data.path": data, "model.name": model})


__all__ = ["criteo_1tb_config", "small_config"]
