"""A described table (CSV, TSV or Parquet files) as a dataset of the preprocessing pipeline (`ingest.run`).

Text files are cut into blocks of whole rows here, in the main process (`text_rows`: a quoted field
may hold a newline); gzip files are first decompressed beside the output (`work_dir/inputs/`), so that
the workers read their blocks in parallel. Parquet files are cut at row groups. Before any row is
read, each file's header (or Parquet schema) must name every column the description uses.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import Iterator

from ctrflow.contract.description import Description
from ctrflow.contract.features import Features
from ctrflow.contract.formats.parquet_read import check_parquet, plan_pieces
from ctrflow.ingest.table.passes import TableFitStage, TableTransformStage, TextBlock
from ctrflow.contract.formats.text_parse import dialect_of
from ctrflow.contract.formats.sources import FileBytes
from ctrflow.contract.formats.text_rows import BOM, check_has_rows, iter_blocks, read_header, scan_quotes
from ctrflow.errors import UserError
from ctrflow.contract.formats.files import is_gzip
from ctrflow.ingest.blocks import bytes_per_block
from ctrflow.ingest.counting import MergeStage
from ctrflow.ingest.string_counts import merge_strings
from ctrflow.ingest.table.lengths import settle_lengths, warn

_HEADER_BYTES = 1 << 20
# Without --chunk-rows: blocks of at most about this much text (Criteo's 131,072 rows are ~31 MB), a
# file's blocks all of one size, and Parquet pieces of at least this many rows. Larger blocks hold each
# distinct value once for more rows: 32 MB blocks cost 15 % less CPU than 131,072-row ones (6 MB) on a
# MovieLens-like table.
BLOCK_BYTES = 32 << 20
PIECE_ROWS = 1 << 19


class TableDataset:
    """What the two-pass pipeline needs of a described table (see `ctrflow.ingest.datasets`)."""

    engines = ("cpu",)

    def __init__(self, description: Description):
        self.description = description
        self.truncated: dict[str, int] = {}
        self._checksums = False

    @property
    def max_lengths(self) -> dict[str, int | None]:
        """Each multi-hot column's max_length (None until `settle` sets it from the training lists)."""
        return {name: m.max_length for name, m in self.description.multi_hot.items()}

    def settle(self, records: list[dict], warnings: list[str]) -> None:
        """After the fit pass (`records`: its blocks'): set each unset max_length from the training lists,
        count the rows cut per multi-hot column, and warn (stderr and `warnings`) of a list column that
        never split (`lengths`)."""
        self.description, self.truncated, found = settle_lengths(self.description, records)
        warn([w for w in found if w not in warnings])
        warnings.extend(w for w in found if w not in warnings)

    def follow(self, previous: Features) -> None:
        """Take each unset max_length from the processed data whose vocabularies this run grows."""
        self.description = self.description.with_max_lengths({f.name: f.max_length for f in previous.sparse})

    @property
    def checksums_pieces(self) -> bool:
        """Text files: the fit workers checksum the pieces of plain files (the input digests)."""
        return self.description.format != "parquet"

    def chunk_rows(self, requested: int | None) -> int | None:
        """Rows per block: `requested`, else None (blocks of `BLOCK_BYTES` of text, `PIECE_ROWS` rows of
        Parquet)."""
        return requested

    def check_inputs(self, paths: list[Path]) -> None:
        """Every file names the described columns (header or Parquet schema): checked before any row."""
        for path in paths:
            if self.description.format == "parquet":
                check_parquet(path, self.description)
            else:
                self.columns_of(path)

    def columns_of(self, path: Path) -> list[str]:
        """A text file's columns: its header's, or the description's `columns`; checked (a file with no
        row is an error)."""
        description = self.description
        opener = gzip.open if is_gzip(path) else open
        try:
            with opener(path, "rb") as f:
                head = f.read(_HEADER_BYTES)
        except (OSError, EOFError) as err:
            raise UserError(f"{path}: cannot read its header ({err})") from None
        dialect = dialect_of(description)
        if not description.header:
            check_has_rows(path, head, 0, len(head) < _HEADER_BYTES)
            return list(description.columns)
        if len(head) == _HEADER_BYTES and head.find(b"\n") < 0:
            raise UserError(f"{path}: line 1: no end of the header line in its first MiB")
        names, header_end = read_header(head, dialect, scan_quotes(head, dialect))
        check_has_rows(path, head, header_end, len(head) < _HEADER_BYTES)
        twice = sorted({n for n in names if names.count(n) > 1 and n in description.used_columns})
        if twice:
            raise UserError(f"{path}: line 1: column {twice[0]!r} appears twice in the header")
        description.check_columns(names, f"{path}'s header")
        return names

    def fit_stage(self, paths, splits, cache_dir: str, valid_fraction: float = 0.0, seed: int = 0, *,
                  stop_at_bad_row: bool = True, run_dir: str = "", spill_entries: int, memory_bytes: int = 0,
                  checksums: bool = False, count: bool = True) -> TableFitStage:
        """Pass 1's stage: parse, validate, count, cache (`checksums`: the tasks carry it)."""
        self._checksums = checksums
        return TableFitStage(self.description, splits, cache_dir, valid_fraction, seed,
                             stop_at_bad_row=stop_at_bad_row, run_dir=run_dir, spill_entries=spill_entries,
                             count=count, memory_bytes=memory_bytes)

    def tasks(self, files: list[tuple[int, tuple[Path, str]]], chunk_rows: int, workers: int,
              work_dir: str = "") -> Iterator:
        """Fit tasks of (file index, (path, split)) in input order: text blocks of whole rows, or Parquet
        pieces of row groups. Gzip text files are decompressed into `work_dir/inputs/` first."""
        for index, (path, _) in files:
            if self.description.format == "parquet":
                yield from plan_pieces(path, index, chunk_rows or PIECE_ROWS)
            else:
                yield from self._text_blocks(Path(path), index, chunk_rows, work_dir)

    def _text_blocks(self, path: Path, index: int, chunk_rows: int, work_dir: str) -> Iterator[TextBlock]:
        columns = self.columns_of(path)
        source, plain = path, not is_gzip(path)
        if not plain:
            source = Path(work_dir or ".") / "inputs" / f"input-{index:05d}.txt"
            source.parent.mkdir(parents=True, exist_ok=True)
            _decompress(path, source)
        dialect = dialect_of(self.description)
        checksum = plain and self._checksums
        with FileBytes(source) as data:
            header_end = len(BOM) if data[:len(BOM)] == BOM else 0
            if self.description.header:  # the header's own quotes say nothing of the rows'
                head = data[:_HEADER_BYTES]
                header_end = read_header(head, dialect, scan_quotes(head, dialect, header_end))[1]
            size = len(data)
            for k, (begin, end, quoted, clean) in enumerate(iter_blocks(data, header_end,
                                                                        self._block_bytes(source, chunk_rows), dialect)):
                yield TextBlock(index, k, str(source), 0 if k == 0 else begin, end, tuple(columns),
                                header_end if k == 0 else 0, quoted, clean, checksum)
            if size <= header_end and checksum and size:  # a header and no row: its pieces make the digest
                yield TextBlock(index, 0, str(source), 0, size, tuple(columns), size, False, True, True)

    @staticmethod
    def _block_bytes(source: Path, chunk_rows: int | None) -> int:
        if chunk_rows:
            return bytes_per_block(source, chunk_rows)
        # blocks of one size, none much smaller: the workers' last blocks end together
        size = os.stat(source).st_size
        return max(1, -(-size // max(1, -(-size // BLOCK_BYTES))))

    def merge_stage(self, runs: list[str], thresholds: list[int], range_entries: int,
                    previous: str = "") -> MergeStage:
        """The vocabulary merge of one column per task (`previous`: the processed data it grows, or "")."""
        return MergeStage(runs, thresholds, range_entries, previous, self.description.sparse, merge_strings)

    def transform_stage(self, data_dir: str, compression: str, vocab_dir: str = "",
                        tables=None) -> TableTransformStage:
        """Pass 2's stage: cached dictionaries → ids → Parquet parts."""
        return TableTransformStage(self.description, data_dir, compression, vocab_dir, tables)


def _decompress(path: Path, target: Path) -> None:
    try:
        with gzip.open(path, "rb") as source, open(target, "wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 22)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise UserError(f"{path}: corrupt or truncated gzip file ({err})") from None
