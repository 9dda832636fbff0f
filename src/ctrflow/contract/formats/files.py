"""Raw input files: find them (paths and glob patterns), tell gzip from plain text."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Sequence

from ctrflow.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Input files in the order given; glob patterns expand sorted. Missing or unreadable files raise."""
    paths: list[Path] = []
    for pattern in patterns:
        text = str(pattern)
        if glob.has_magic(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise UserError(f"{text}: no file matches this pattern")
            paths.extend(Path(m) for m in matches)
        else:
            paths.append(Path(text))
    for path in paths:
        if not path.is_file():
            raise UserError(f"{path}: no such file")
        if not os.access(path, os.R_OK):
            raise UserError(f"{path}: not readable (permission denied)")
    return paths


def is_gzip(path: str | os.PathLike) -> bool:
    """True when the file starts with the gzip magic bytes (whatever its name)."""
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC
