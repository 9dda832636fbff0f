"""The ranking model as an ONNX graph: dense [B, num_dense], sparse [B, slots] -> probability [B, 1]
(each input only where the feature contract has such columns: `ctrflow.serve.model_inputs`)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ctrflow.serve import model_inputs
from ctrflow.serve.ranking import example_inputs, served_module

PROTOBUF_LIMIT = 2**31 - 1  # one ONNX protobuf file cannot exceed 2 GB
HEADROOM = 64 * 2**20  # graph structure and non-parameter constants beside the weights
OPSET = 18


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers: decides whether the weights fit in one protobuf."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def _quiet_logs():
    # "torch.__trace" feeds structured-trace handlers, which log capture (pytest) makes costly
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.__trace", "torch.export")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_onnx(model: nn.Module, features, path: str | os.PathLike) -> list[Path]:
    """Export `model` (eval mode, CPU) of the feature contract `features` to `path`; returns the
    files written. The graph's inputs are `model_inputs(features)`, its output `probability`.

    Weights go into the one file while it stays under ONNX's 2 GB protobuf limit, and into
    external data beside it (`model.onnx.data`, which onnxruntime reads from the same folder)
    beyond that.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    external = parameter_bytes(model) + HEADROOM > PROTOBUF_LIMIT
    batch = torch.export.Dim("batch")
    names = list(model_inputs(features))
    wrapped = served_module(model, features)
    # the exporter narrates every pass on stdout and warns about optional torchvision ops
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _quiet_logs():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped, example_inputs(features), str(path), dynamo=True, opset_version=OPSET,
            input_names=names, output_names=["probability"], dynamic_shapes={n: {0: batch} for n in names},
            external_data=external, verbose=False, report=False,
        )
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name))
