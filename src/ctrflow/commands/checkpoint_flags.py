"""`--checkpoint CKPT [--last]`, shared by the commands that read a trained model (evaluate, export,
predict): a run directory means its best checkpoint by validation AUC (its `best` file; the last one
when the run never validated), `--last` its last one (`latest`, what `--resume` continues from), and a
step directory (`CKPT/step_00000097`) itself."""

from __future__ import annotations

import argparse


def add_checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint` (required) and `--last`."""
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint directory (`ctrflow train --out`: its best step by validation AUC) "
                             "or one step directory of it")
    parser.add_argument("--last", action="store_true",
                        help="read the run's last checkpoint instead of its best")


def chosen_checkpoint(args: argparse.Namespace) -> str:
    """The step directory the flags mean, as a path string."""
    from ctrflow.checkpoint import BEST, LAST, resolve_checkpoint  # torch: only when the command runs

    return str(resolve_checkpoint(args.checkpoint, pick=LAST if args.last else BEST))
