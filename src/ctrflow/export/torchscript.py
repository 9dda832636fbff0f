"""The ranking model as TorchScript for Triton's PyTorch (libtorch) backend:
dense [B, 13], sparse [B, 26] -> probability [B, 1] in `model.pt`."""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from ctrflow.export.onnx_model import example_inputs
from ctrflow.serve.ranking import ProbabilityModel


@contextlib.contextmanager
def _quiet_deprecation():
    # TorchScript is deprecated in torch 2.13 but still what the libtorch backend loads; the
    # DeprecationWarning on every trace/save/load says nothing the caller can act on
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)
        yield


def export_torchscript(model: nn.Module, path: str | os.PathLike) -> Path:
    """Trace `model` (eval mode, CPU) wrapped to output probability [B, 1] and save it to `path`.

    Tracing (not scripting): the models' Python (lists of tables, dicts of weights) does not
    script, and their forward has no data-dependent control flow. The trace runs on two rows and
    is checked by torch on the same inputs; `validate` compares it on held-out rows of other
    batch sizes. Triton moves the module to its instance's device; the traces of ctrflow's models
    record no device constants (tests/unit/test_export.py checks), so GPU instances work too.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapped = ProbabilityModel(model).eval()
    with _quiet_deprecation(), torch.no_grad():
        traced = torch.jit.trace(wrapped, example_inputs())
        torch.jit.save(traced, str(path))
    return path


def load_torchscript(path: str | os.PathLike) -> torch.jit.ScriptModule:
    """The saved module, on CPU, as Triton's libtorch backend loads it."""
    with _quiet_deprecation():
        return torch.jit.load(str(path), map_location="cpu").eval()
