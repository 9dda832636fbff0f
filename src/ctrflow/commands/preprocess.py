"""`ctrflow preprocess`: raw rows (plain or gzip, globs) → Parquet + schema + vocabularies.

`--dataset criteo` (the default) reads the raw Criteo TSV; `--dataset FILE` a CSV, TSV or Parquet table
described by a YAML or JSON file (`ctrflow.contract.description`). `ctrflow preprocess --train ... --out
DIR` does everything in one process tree. For many machines the same work is split per input file
(`ctrflow.ingest.fanout`): `count` (each file; it takes `--dataset`) → `merge` → `transform` (each file)
→ `finalize`, with the same output; the per-file steps run the CPU engine whatever `--engine` says.
`--vocab-from PREV_DATA_DIR` (the single run, or `merge`) grows an earlier output's vocabularies.
"""

from __future__ import annotations

import argparse
import json
import os

from ctrflow.errors import UserError
from ctrflow.tracking import add_tracking_flags, tracker_from_args

# Everything the step writes is closed and renamed into place when `run` returns: the process ends
# without tearing the interpreter down (`ctrflow.cli.exit_at_once`).
EXIT_AT_ONCE = True
ACTIONS = {
    "count": "per-file fan-out, step 1: count one file's values into COUNTS_DIR",
    "merge": "step 2: merge every COUNTS_DIR into the vocabularies and the part numbering",
    "transform": "step 3: one file -> Parquet parts, numbered as a single run numbers them",
    "finalize": "step 4: vocabulary + parts + counts -> the dataset (schema.json, stats.json)",
}


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    # no argparse choices: a retired engine (cudf) gets a one-line error saying what to use instead
    parser.add_argument("--engine", default="cpu", metavar="{cpu,gpu}",
                        help="cpu (numpy workers); gpu (--dataset criteo only: parse, count and transform on "
                             "--device, one process; the per-file steps run on the CPU); same output either way")
    parser.add_argument("--device", default="cuda", help="torch device of --engine gpu (cuda, cuda:1, cpu)")


def _file_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, metavar="FILE", help="one raw file (plain or gzip, or Parquet)")
    parser.add_argument("--file-index", "--part-index", dest="file_index", type=int, default=0,
                        help="the file's position in the input order (train files first, then valid)")
    parser.add_argument("--split", default="train", choices=["train", "valid"], help="which split the file feeds")
    parser.add_argument("--valid-fraction", type=float, default=None,
                        help="train files: send this fraction of rows to valid (seeded per row and file index)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --valid-fraction split")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="rows per block (same in every step; default as the single run's)")
    parser.add_argument("--on-bad-rows", default="error", choices=["error", "skip"])
    parser.add_argument("--workers", type=int, default=1, help="worker processes for this file")
    _engine_flags(parser)


def _configure_actions(parser: argparse.ArgumentParser) -> None:
    from ctrflow.ingest.run import COMPRESSIONS, DEFAULT_COMPRESSION

    actions = parser.add_subparsers(dest="action", metavar="[count|merge|transform|finalize]")
    count = actions.add_parser("count", help=ACTIONS["count"], description=ACTIONS["count"])
    _file_flags(count)
    count.add_argument("--out", required=True, metavar="COUNTS_DIR")
    _dataset_flag(count, default=None)
    merge = actions.add_parser("merge", help=ACTIONS["merge"], description=ACTIONS["merge"])
    merge.add_argument("--counts", nargs="+", required=True, metavar="COUNTS_DIR")
    merge.add_argument("--out", required=True, metavar="MERGED_DIR")
    merge.add_argument("--freq-threshold", type=int, default=None,
                       help="the default threshold (default: the dataset description's; 6 for criteo)")
    merge.add_argument("--workers", type=int, default=1, help="threads merging columns")
    _vocab_from_flag(merge)
    transform = actions.add_parser("transform", help=ACTIONS["transform"], description=ACTIONS["transform"])
    _file_flags(transform)
    transform.add_argument("--vocab", required=True, metavar="MERGED_DIR", help="the merge step's output")
    transform.add_argument("--out", required=True, metavar="PARTS_DIR")
    transform.add_argument("--compression", default=DEFAULT_COMPRESSION, choices=COMPRESSIONS)
    finalize = actions.add_parser("finalize", help=ACTIONS["finalize"], description=ACTIONS["finalize"])
    finalize.add_argument("--counts", nargs="+", required=True, metavar="COUNTS_DIR")
    finalize.add_argument("--vocab", required=True, metavar="MERGED_DIR")
    finalize.add_argument("--parts", nargs="+", required=True, metavar="PARTS_DIR")
    finalize.add_argument("--out", required=True, metavar="DIR")


def _vocab_from_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab-from", default=None, metavar="PREV_DATA_DIR",
                        help="grow the vocabularies of an earlier output of the same dataset (yesterday's): its "
                             "values keep their ids, new values reaching the threshold get the next ids "
                             "(docs/continuous-training.md); CPU engine")


def _dataset_flag(parser: argparse.ArgumentParser, default: str | None = "criteo") -> None:
    parser.add_argument("--dataset", default=default, metavar="criteo|FILE",
                        help="the raw Criteo TSV (default), or a YAML/JSON file describing a CSV, TSV or Parquet "
                             "table: format, label, dense, categorical, multi_hot columns (see docs/datasets.md)")


def _import_without_blas_threads() -> None:
    """Import the preprocessing library (numpy first) with OpenBLAS kept to this thread: the step never
    multiplies matrices, and OpenBLAS's threads spin ~0.1 CPU-s when numpy loads it, beside the startup.
    The setting is read when numpy loads, and this process's environment is restored right after (the
    processes it starts, and numpy where it was loaded already, keep theirs)."""
    name = "OPENBLAS_NUM_THREADS"
    before = os.environ.get(name)
    os.environ.setdefault(name, "1")
    try:
        import ctrflow.ingest.run  # noqa: F401
    finally:
        if before is None:
            os.environ.pop(name, None)


def configure(parser: argparse.ArgumentParser) -> None:
    """Flags of the preprocess step (names are a contract: the step contract in docs/) and its fan-out actions."""
    _import_without_blas_threads()
    from ctrflow.ingest.criteo.dataset import DEFAULT_CHUNK_ROWS
    from ctrflow.ingest.run import COMPRESSIONS, DEFAULT_COMPRESSION

    # --train/--out are required for the single run; checked in `run` so that the actions parse
    parser.add_argument("--train", nargs="+", default=[], metavar="FILE",
                        help="training files or glob patterns, in the --dataset's format (a described table: "
                             "its format and columns; criteo: 40 columns, label, I1..I13, C1..C26)")
    parser.add_argument("--valid", nargs="+", default=[], metavar="FILE",
                        help="validation files or glob patterns")
    parser.add_argument("--out", default=None, help="output directory (replaced atomically)")
    _dataset_flag(parser)
    parser.add_argument("--freq-threshold", type=int, default=None,
                        help="a value needs this many occurrences in the training split to get its own id "
                             "(default: the dataset description's default; 6 for criteo); per-column "
                             "thresholds of the description apply beside it")
    parser.add_argument("--valid-fraction", type=float, default=None,
                        help="without --valid: send this fraction of the training rows to valid (seeded, per row)")
    _vocab_from_flag(parser)
    _engine_flags(parser)
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: all cores)")
    parser.add_argument("--on-bad-rows", default="error", choices=["error", "skip"],
                        help="stop at the first malformed row, or skip it and list it in DIR/rejected.tsv")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --valid-fraction split")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help=f"about this many rows per block and Parquet part (sets memory per worker; default: "
                             f"{DEFAULT_CHUNK_ROWS} for criteo, about 32 MB of text per block of a described table)")
    parser.add_argument("--compression", default=DEFAULT_COMPRESSION, choices=COMPRESSIONS,
                        help="Parquet compression of the parts (none: fastest; snappy/zstd: smaller files)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: on a terminal, off in CI)")
    add_tracking_flags(parser)
    _configure_actions(parser)


def _run_action(args: argparse.Namespace) -> dict:
    from ctrflow.ingest import fanout
    from ctrflow.ingest.engines import check_engine

    if args.action in ("count", "transform"):
        check_engine(args.engine)  # either engine: these steps run the CPU engine's passes (same output)
    per_file = {} if args.action in ("merge", "finalize") else dict(
        file_index=args.file_index, split=args.split, valid_fraction=args.valid_fraction, seed=args.seed,
        chunk_rows=args.chunk_rows, on_bad_rows=args.on_bad_rows, workers=args.workers)
    if args.action == "count":
        summary = fanout.count_file(args.input, args.out, dataset=args.dataset or "criteo", **per_file)
        return {"out": args.out, "file_index": args.file_index, **summary["stats"]}
    if args.action == "merge":
        merged = fanout.merge_counts(args.counts, args.out, args.freq_threshold, args.workers,
                                     vocab_from=args.vocab_from)
        return {"out": args.out, "files": merged["files"]}
    if args.action == "transform":
        return {"out": args.out, **fanout.transform_file(args.input, args.vocab, args.out,
                                                         compression=args.compression, **per_file)}
    return fanout.finalize(args.out, args.counts, args.vocab, args.parts)


def _imports_for(dataset: str | None):
    """A described table's run keeps pandas out of its processes (`without_pandas`); Criteo's passes use it."""
    from contextlib import nullcontext

    from ctrflow.ingest.without_pandas import pandas_unavailable

    return nullcontext() if dataset is None or str(dataset) == "criteo" else pandas_unavailable()


def run(args: argparse.Namespace) -> int:
    """Run the step (or one fan-out action); prints a one-line JSON summary."""
    from ctrflow.ingest.run import preprocess

    if getattr(args, "action", None):
        summary = _run_action(args)
        print(json.dumps({k: v for k, v in summary.items() if k != "cardinalities"}))
        return 0
    if not args.train or not args.out:
        raise UserError("give --train FILE... and --out DIR (or one of: count, merge, transform, finalize)")
    with tracker_from_args(args, "preprocess") as tracker, _imports_for(args.dataset):
        summary = preprocess(args.train, args.valid, args.out, freq_threshold=args.freq_threshold,
                             valid_fraction=args.valid_fraction, workers=args.workers,
                             on_bad_rows=args.on_bad_rows, engine=args.engine, seed=args.seed,
                             tracker=tracker, chunk_rows=args.chunk_rows, progress=args.progress,
                             compression=args.compression, device=args.device, dataset=args.dataset,
                             vocab_from=args.vocab_from, detach_removal=True)
    print(json.dumps({k: summary[k] for k in ("out", "rows", "rows_read", "rows_rejected", "seconds")}))
    return 0
