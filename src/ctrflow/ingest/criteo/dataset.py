"""The raw Criteo TSV as a dataset of the preprocessing pipeline (`ingest.run`): its worker stages.

The CPU engine's passes (`passes`) parse the fixed 40-field layout with its fast paths (8-byte keys);
`--engine gpu` runs `gpu_preprocess` instead. Both give the output `ctrflow preprocess` always gave.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator

from ctrflow.contract.criteo import criteo_description
from ctrflow.ingest.criteo.passes import FitStage, TransformStage, WholeFile
from ctrflow.contract.description import DEFAULT_THRESHOLD
from ctrflow.ingest.counting import MergeStage
from ctrflow.contract.formats.files import is_gzip
from ctrflow.contract.formats.text_rows import check_has_rows
from ctrflow.ingest.blocks import bytes_per_block, plan_blocks

_HEAD_BYTES = 1 << 16
DEFAULT_CHUNK_ROWS = 1 << 17  # Criteo rows per block and Parquet part: sets memory per worker (~2 KB per row in flight)


class CriteoDataset:
    """What the two-pass pipeline needs of the Criteo TSV (see `ctrflow.ingest.datasets`)."""

    engines = ("cpu", "gpu")
    checksums_pieces = True  # the fit workers checksum plain files' pieces (the input digests)
    max_lengths: dict[str, int] = {}
    truncated: dict[str, int] = {}

    def __init__(self, freq_threshold: int | None = None):
        self.description = criteo_description(DEFAULT_THRESHOLD if freq_threshold is None else freq_threshold)

    def chunk_rows(self, requested: int | None) -> int:
        """Rows per block: `requested`, else 131,072."""
        return requested or DEFAULT_CHUNK_ROWS

    def check_inputs(self, paths: list[Path]) -> None:
        """A file with no row (0 bytes, or empty lines only) stops the run before any work; nothing else
        is checked before reading: the layout is fixed (a bad row is found where it is)."""
        for path in paths:
            try:
                with (gzip.open if is_gzip(path) else open)(path, "rb") as f:
                    head = f.read(_HEAD_BYTES)
            except (OSError, EOFError):  # a corrupt gzip file: the fit pass names the line it breaks at
                continue
            check_has_rows(path, head, 0, len(head) < _HEAD_BYTES)

    def settle(self, records: list[dict], warnings: list[str]) -> None:
        """Nothing the fit pass decides beyond the vocabularies (no list column)."""

    def follow(self, previous) -> None:
        """Nothing to take from the processed data a run grows (the layout is fixed)."""

    def fit_stage(self, paths, splits, cache_dir: str, valid_fraction: float = 0.0, seed: int = 0, *,
                  stop_at_bad_row: bool = True, run_dir: str = "", spill_entries: int, memory_bytes: int = 0,
                  checksums: bool = False, count: bool = True) -> FitStage:
        """Pass 1's stage: parse, validate, count, cache."""
        return FitStage(paths, splits, cache_dir, valid_fraction, seed, stop_at_bad_row=stop_at_bad_row,
                        run_dir=run_dir, spill_entries=spill_entries, count=count, memory_bytes=memory_bytes,
                        checksums=checksums)

    def tasks(self, files: list[tuple[int, tuple[Path, str]]], chunk_rows: int, workers: int,
              work_dir: str = "") -> Iterator:
        """Fit tasks of (file index, (path, split)) in input order. Plain files: byte ranges each worker
        reads itself. Gzip files: whole files when there are enough of them to keep every worker busy
        (each worker decompresses its own), else blocks decompressed here. The blocks, and so the output,
        are the same either way."""
        gzipped = [is_gzip(path) for _, (path, _) in files]
        whole = workers > 1 and sum(gzipped) >= workers
        for (index, (path, _)), gz in zip(files, gzipped):
            if whole and gz:
                yield WholeFile(index, bytes_per_block(path, chunk_rows))
            else:
                yield from plan_blocks(path, index, bytes_per_block(path, chunk_rows))

    def merge_stage(self, runs: list[str], thresholds: list[int], range_entries: int,
                    previous: str = "") -> MergeStage:
        """The vocabulary merge of one column per task (`previous`: the processed data it grows, or "")."""
        return MergeStage(runs, thresholds, range_entries, previous, self.description.sparse)

    def transform_stage(self, data_dir: str, compression: str, vocab_dir: str = "", tables=None) -> TransformStage:
        """Pass 2's stage: cached keys → ids → Parquet parts."""
        return TransformStage(self.description, data_dir, compression, vocab_dir, tables)

    def run_gpu(self, files, tmp: Path, fraction: float, workers: int, on_bad_rows: str, seed: int,
                chunk_rows: int, progress: bool, compression: str, device: str) -> dict | None:
        """Both passes on a torch device (`gpu_preprocess`); None where the CPU engine must run instead."""
        from ctrflow.ingest.criteo.gpu_preprocess import UnsupportedInput, run_gpu

        try:
            return run_gpu(files, tmp, self.description.default_threshold, fraction, workers, on_bad_rows, seed,
                           chunk_rows, progress, compression, device)
        except UnsupportedInput:  # e.g. C values not 8 hex digits: the CPU engine's path, same output
            return None

