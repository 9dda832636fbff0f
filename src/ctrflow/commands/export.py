"""`ctrflow export --checkpoint CKPT --data DIR --out REPO --name NAME [--base REPO --keep-versions 2]`:
a Triton model repository, or the next version of one."""

from __future__ import annotations

import argparse
import json

from ctrflow.commands.checkpoint_flags import add_checkpoint_flags, chosen_checkpoint
from ctrflow.tracking import add_tracking_flags, tracker_from_args


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of the export step."""
    add_checkpoint_flags(parser)
    parser.add_argument("--data", required=True, help="processed data directory: vocabularies and held-out rows")
    parser.add_argument("--out", default=None,
                        help="Triton model repository: a new or empty folder, or a repository to add the ensemble "
                             "to (an earlier export of NAME is replaced, other models stay); with --base: default "
                             "the base itself")
    parser.add_argument("--base", default=None,
                        help="repository serving the previous version of NAME: write the next version beside it, "
                             "with the delta from it (NAME_model/<k>/delta/)")
    parser.add_argument("--keep-versions", type=int, default=2,
                        help="with --base: keep the newest N versions (2 or more keeps the switch without downtime)")
    parser.add_argument("--name", default="ctr", help="ensemble name; its parts are NAME_preprocess, NAME_model")
    parser.add_argument("--backend", choices=("onnxruntime", "pytorch", "python"), default=None,
                        help="ranking model backend: an ONNX graph, TorchScript on the PyTorch (libtorch) "
                             "backend, or PyTorch on the python backend (serves on any Triton build); "
                             "default onnxruntime, or the base's")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="Triton max_batch_size of every model (default 4096, or the base's)")
    parser.add_argument("--instance-kind", choices=("cpu", "gpu"), default=None,
                        help="where the ranking model's instances run (default cpu, or the base's)")
    parser.add_argument("--validation-rows", type=int, default=4096,
                        help="held-out rows the exported model is compared on with the trained one")
    parser.add_argument("--metrics", default=None,
                        help="evaluate's metrics.json for this checkpoint (or its directory): its AUC tags "
                             "the registered version, for `ctrflow promote` without --data")
    add_tracking_flags(parser)


def run(args: argparse.Namespace) -> int:
    """Export, validate, register; print a one-line JSON summary."""
    from ctrflow.export import export

    with tracker_from_args(args, "export") as tracker:
        summary = export(chosen_checkpoint(args), args.data, args.out, args.name, backend=args.backend,
                         max_batch_size=args.max_batch_size, instance_kind=args.instance_kind,
                         validation_rows=args.validation_rows, metrics=args.metrics, tracker=tracker,
                         base=args.base, keep_versions=args.keep_versions)
    print(json.dumps(summary))
    return 0
