"""`ctrflow pipeline compile|run --local|submit|launch-spec`: the KFP pipeline of the repository's `pipelines/`.

The pipeline code lives beside the library (pipelines → components → ctrflow); this command only
imports it, so kfp is loaded only when the pipeline is used.
"""

from __future__ import annotations

import argparse
import importlib

from ctrflow.errors import UserError


def _pipelines_cli():
    try:
        return importlib.import_module("pipelines.cli")
    except ModuleNotFoundError as err:
        if err.name not in ("pipelines", "components", "kfp", "kfp.kubernetes"):
            raise
        raise UserError(f"cannot import {err.name!r}: run from a ctrflow checkout with its "
                        f"pipelines/ and components/ installed (pip install -e .; the pipeline "
                        f"needs kfp==2.17.0 and kfp-kubernetes==2.17.0)") from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of `ctrflow pipeline` (one per pipeline parameter)."""
    _pipelines_cli().configure(parser)


def run(args: argparse.Namespace) -> int:
    """Compile, run locally or submit."""
    return _pipelines_cli().run(args)
