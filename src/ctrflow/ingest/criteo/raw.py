"""The raw Criteo format: read and validate a file block by block in one process.

A row is one line of tab-separated fields: label, I1..I13 (integers, may be negative or empty),
C1..C26 (usually 8 hex digits, or empty). Kaggle's test layout has no label (39 fields).
Parsing a block (`parsing`, re-exported here) is pyarrow's CSV reader; only a block that fails
the fast, typed parse is re-checked line by line to name each bad row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from ctrflow.ingest.criteo.parsing import (TEST_COLUMNS, ParsedBlock, count_lines, line_starts,  # noqa: F401
                                             parse_block, parse_integers)
from ctrflow.errors import UserError
from ctrflow.ingest.blocks import plan_blocks, read_block, truncation_message


def read_raw(path: str | os.PathLike, with_label: bool = True, block_bytes: int = 64 << 20) -> Iterator[ParsedBlock]:
    """Parse a raw file block by block (in one process); the first bad row raises `UserError` with file:line."""
    path = Path(path)
    first_line = 1
    for block in plan_blocks(path, 0, block_bytes):
        _, data = read_block(path, block)
        if block.truncated:
            raise UserError(truncation_message(path, first_line + count_lines(data) - 1, data))
        parsed = parse_block(data, with_label)
        if parsed.problems:
            line, reason, _ = parsed.problems[0]
            raise UserError(f"{path}: line {first_line + line}: {reason}")
        first_line += parsed.lines
        yield parsed
