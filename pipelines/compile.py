"""Compile the pipelines to KFP's IR YAML (the committed `pipeline.yaml` and `daily_pipeline.yaml`
are this output)."""

from __future__ import annotations

import contextlib
import inspect
import os
from pathlib import Path
from typing import Iterator

from kfp import compiler

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "pipeline.yaml"
DAILY_COMMITTED = REPO / "daily_pipeline.yaml"
PIPELINES = ("ctrflow", "daily")  # `--pipeline` choices: the whole chain once, the daily cycle
COMMITTED_FILES = {"ctrflow": COMMITTED, "daily": DAILY_COMMITTED}


def pipeline_function(pipeline: str = "ctrflow"):
    """The @dsl.pipeline called `pipeline` ("ctrflow": raw data to export; "daily": one day's cycle)."""
    if pipeline == "daily":
        from ctrflow_pipelines.daily import daily_pipeline

        return daily_pipeline
    from ctrflow_pipelines.pipeline import ctrflow_pipeline

    return ctrflow_pipeline


@contextlib.contextmanager
def tasks_in(image: str | None) -> Iterator[None]:
    """Within: every task of both pipelines runs in `image` (None: the components' own image)."""
    from ctrflow_components.image import TRAIN_IMAGE, use_image

    for pipeline in PIPELINES if image else ():
        use_image(pipeline_function(pipeline), image)
    try:
        yield
    finally:
        for pipeline in PIPELINES if image else ():
            use_image(pipeline_function(pipeline), TRAIN_IMAGE)


def compile_pipeline(out: str | os.PathLike = COMMITTED, pipeline: str = "ctrflow") -> Path:
    """Write `pipeline`'s IR YAML to `out`; returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline_function(pipeline), str(out))
    return out


def pipeline_parameters(pipeline: str = "ctrflow") -> dict[str, inspect.Parameter]:
    """`pipeline`'s parameters by name, with their defaults (`inspect.Parameter.empty`: required) and types."""
    return dict(inspect.signature(pipeline_function(pipeline).pipeline_func).parameters)
