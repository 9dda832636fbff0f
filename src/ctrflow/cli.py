"""`ctrflow <step>`: one subcommand per pipeline step.

Each step lives in `ctrflow.commands.<name>` with `configure(parser)` and `run(args) -> int`;
modules are imported only when their step runs, so `ctrflow synth` never pays for torch or mlflow.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ctrflow import __version__
from ctrflow.errors import UserError

COMMANDS = {
    "synth": "write synthetic Criteo-format day files",
    "preprocess": "raw Criteo TSV -> Parquet + schema + vocabularies",
    "train": "train DLRM / DCNv2 / DeepFM / Wide&Deep",
    "tune": "search hyperparameters: an Optuna study of ctrflow train runs",
    "evaluate": "exact AUC, logloss, calibration, plots",
    "export": "write a Triton model repository",
    "predict": "score raw rows with a checkpoint",
    "promote": "move the registry's champion alias to the candidate (AUC gate)",
    "serve": "serve an exported repository with a real tritonserver on 127.0.0.1",
    "pipeline": "compile, run locally or submit the KFP pipeline",
    "demo": "synthetic data -> whole pipeline locally -> MLflow run",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctrflow", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ctrflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<step>", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        step = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # configure only the step that runs: imports stay lazy
            importlib.import_module(f"ctrflow.commands.{name}").configure(step)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ctrflow` console script."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(f"ctrflow.commands.{args.command}")
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"ctrflow {args.command}: error: {err}", file=sys.stderr)
        return 2
