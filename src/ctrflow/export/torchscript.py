"""The ranking model as TorchScript for Triton's PyTorch (libtorch) backend:
dense [B, num_dense], sparse [B, slots] -> probability [B, 1] in `model.pt` (each input only where
the feature contract has such columns: `ctrflow.serve.model_inputs`)."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ctrflow.serve.ranking import example_inputs, served_module


@contextlib.contextmanager
def _quiet_deprecation():
    # TorchScript is deprecated in torch 2.13 but still what the libtorch backend loads; the
    # DeprecationWarning on every trace/save/load says nothing the caller can act on
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)
        yield


def export_torchscript(model: nn.Module, features, path: str | os.PathLike) -> Path:
    """Trace `model` (eval mode, CPU) of the feature contract `features`, wrapped to output
    probability [B, 1], and save it to `path`.

    Tracing (not scripting): the models' Python (lists of tables, dicts of weights) does not
    script, and their forward has no data-dependent control flow. The trace runs on two rows and
    is checked by torch on the same inputs; `validate` compares it on held-out rows of other
    batch sizes. Triton moves the module to its instance's device; the traces of ctrflow's models
    record no device constants (tests/integration/steps/test_export.py checks), so GPU instances work too.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapped = served_module(model, features)
    with _quiet_deprecation(), torch.no_grad():
        traced = torch.jit.trace(wrapped, example_inputs(features))
        torch.jit.save(traced, str(path))
    return path


def load_torchscript(path: str | os.PathLike) -> torch.jit.ScriptModule:
    """The saved module, on CPU, as Triton's libtorch backend loads it."""
    with _quiet_deprecation():
        return torch.jit.load(str(path), map_location="cpu").eval()
