"""A text file's bytes for the block planner and the raw reader: read on demand, or mapped."""

from __future__ import annotations

import mmap
import os
from pathlib import Path


class FileBytes:
    """A file's bytes, read on demand (`os.pread`) rather than mapped: a scan of the whole file then costs
    a copy from the page cache, not a page fault per 4 KiB (measured the larger cost). Indexing by slice,
    `len` and `find`, as for `bytes`."""

    _FIND_BYTES = 4 << 20

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        lo, hi, _ = key.indices(self.size)
        return os.pread(self.fd, max(0, hi - lo), lo) if hi > lo else b""

    def find(self, sub: bytes, start: int = 0, end: int | None = None) -> int:
        """The first offset of `sub` in [start, end), or -1 (read in pieces growing from 64 KiB: a row end is
        near)."""
        end = self.size if end is None else min(end, self.size)
        lo, step = start, 1 << 16
        while lo < end:
            chunk = self[lo:min(lo + step + len(sub) - 1, end)]
            at = chunk.find(sub)
            if at >= 0:
                return lo + at
            lo, step = lo + step, min(step * 4, self._FIND_BYTES)
        return -1

    def close(self) -> None:
        """Release the file."""
        os.close(self.fd)

    def __enter__(self) -> "FileBytes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_mapped(path: Path):
    """The file memory-mapped read-only (an empty file: b"")."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
