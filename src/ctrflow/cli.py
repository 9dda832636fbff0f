"""`ctrflow <step>`: one subcommand per pipeline step.

Each step lives in `ctrflow.commands.<name>` with `configure(parser)` and `run(args) -> int`;
modules are imported only when their step runs, so `ctrflow synth` never pays for torch or mlflow.
Other installed packages add commands through the `ctrflow.commands` entry point group (a module
with `HELP`, `configure` and `run`): the KFP pipeline package registers `ctrflow pipeline` and
`ctrflow demo` that way, so the library never imports it.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from types import ModuleType

from ctrflow import __version__
from ctrflow.errors import UserError

COMMANDS = {
    "synth": "write synthetic click logs (Criteo-format days, or described tables such as movielens-like)",
    "preprocess": "raw rows (the Criteo TSV, or any CSV/TSV/Parquet table a --dataset file describes) -> Parquet + schema + vocabularies",
    "multihot": "expand a preprocessed one-hot dataset into MLPerf DLRMv2's multi-hot one",
    "train": "train DLRM / DCNv2 / DeepFM / Wide&Deep",
    "tune": "search hyperparameters: an Optuna study of ctrflow train runs",
    "evaluate": "exact AUC, logloss, calibration, plots",
    "export": "write a Triton model repository",
    "predict": "score raw rows with a checkpoint",
    "promote": "move the registry's champion alias to the candidate (AUC gate)",
    "serve": "serve an exported repository with a real tritonserver on 127.0.0.1",
}
ENTRY_POINTS = "ctrflow.commands"


def installed_commands() -> dict[str, ModuleType]:
    """Commands other packages register in the `ctrflow.commands` entry point group, by name
    (a built-in step's name cannot be taken)."""
    from importlib.metadata import entry_points

    found = {}
    for point in entry_points(group=ENTRY_POINTS):
        if point.name in COMMANDS or point.name in found:
            continue
        try:
            found[point.name] = point.load()
        except ModuleNotFoundError as err:  # e.g. an image that installed the library alone
            print(f"ctrflow: command {point.name!r} unavailable ({err})", file=sys.stderr)
    return found


def command_module(name: str) -> ModuleType:
    """The module of command `name`: a built-in step or an installed one."""
    if name in COMMANDS:
        return importlib.import_module(f"ctrflow.commands.{name}")
    return installed_commands()[name]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows every option's default: "(default: X)" after its help, unless the help
    already says it; flags (off unless given), required options and positionals show none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not shows_default(action):
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and shows_default(action):  # argparse prints nothing for an option without help
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def shows_default(action: argparse.Action) -> bool:
    """Whether `--help` states `action`'s default (an optional, non-flag, not required option)."""
    return (bool(action.option_strings) and not action.required and action.nargs != 0
            and action.default is not argparse.SUPPRESS)


class Parser(argparse.ArgumentParser):
    """`ctrflow`'s parsers, sub-commands' included: help entries show defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The `ctrflow` parser for `argv`: every command listed, only the chosen one's flags configured."""
    parser = Parser(prog="ctrflow", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"ctrflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<step>", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    # installed commands are looked up only when no built-in step was chosen: the steps start faster
    extra = {} if chosen in COMMANDS else installed_commands()
    helps = {**COMMANDS, **{name: getattr(module, "HELP", "") for name, module in extra.items()}}
    for name, help_text in helps.items():
        step = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # configure only the step that runs: imports stay lazy
            (extra[name] if name in extra else command_module(name)).configure(step)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `ctrflow` console script (`argv` None: this process's own command line)."""
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = None
    try:
        if args.command in COMMANDS and hasattr(args, "tracking_uri"):
            # the step's MLflow run starts now, in a child beside the step's own imports (ctrflow.tracking.child)
            from ctrflow.tracking.child import prepare_from_args

            prepare_from_args(args)
        module = command_module(args.command)
        code = int(module.run(args) or 0)
    except UserError as err:  # one line; a stopped run has its own label and exit code (130, 143)
        if not getattr(err, "quiet", False):
            print(f"ctrflow {args.command}: {getattr(err, 'label', 'error')}: {err}", file=sys.stderr)
        code = getattr(err, "exit_code", 2)
    if own_process and getattr(module, "EXIT_AT_ONCE", False):
        exit_at_once(code)
    return code


def exit_at_once(code: int) -> None:
    """End this process now that its step is done: exit handlers run and output is flushed, but the
    interpreter does not free its objects and modules one by one (0.05-0.3 s after a preprocess run,
    measured). Returns, for the normal exit, while a thread other than daemons is still running."""
    import atexit
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: the normal exit would not write it either
            pass
    os._exit(code)
