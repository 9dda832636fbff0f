"""The engines `ctrflow preprocess --engine` runs on: "cpu" (numpy kernels, `ctrflow.contract.kernels`,
on worker processes) and "gpu" (`ctrflow.ingest.criteo.gpu_engine`: parse, count and transform on one
torch device), with the same output."""

from __future__ import annotations

from ctrflow.errors import UserError

ENGINES = ("cpu", "gpu")


def check_engine(name: str) -> None:
    """A one-line UserError unless `name` is an engine of `preprocess` ("cpu" or "gpu")."""
    if name == "cudf":
        raise UserError("--engine cudf is not available (cuDF cannot run here): use --engine gpu, "
                        "which parses, counts and transforms on a torch device with the same output")
    if name not in ENGINES:
        raise UserError(f"--engine must be one of {', '.join(ENGINES)}, got {name!r}")
