"""Compile the pipeline to KFP's IR YAML (the committed `pipeline.yaml` is this output)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from kfp import compiler

from ctrflow_pipelines.pipeline import ctrflow_pipeline

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "pipeline.yaml"


def compile_pipeline(out: str | os.PathLike = COMMITTED) -> Path:
    """Write the pipeline's IR YAML to `out`; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(ctrflow_pipeline, str(out))
    return out


def pipeline_parameters() -> dict[str, inspect.Parameter]:
    """The pipeline's parameters by name, with their defaults and types."""
    return dict(inspect.signature(ctrflow_pipeline.pipeline_func).parameters)
