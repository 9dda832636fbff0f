"""Page-cache control for the loader benchmarks: evict a split, check what stayed cached, read the disk.

Timings "from disk" are only as good as the eviction: `drop_page_cache` says how it evicted and
`cached_fraction` (mincore over the files) what is left, so every cold number comes with its check.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def drop_page_cache(root: Path, split: str = "train") -> str:
    """Evict the parts from the page cache; returns how. As root: `sync` then `drop_caches`; else
    fsync + posix_fadvise(DONTNEED) per file (DONTNEED keeps dirty pages: a split just written
    would still be read from memory without the fsync). Check with `cached_fraction`."""
    parts = sorted((root / split).glob("part-*.parquet"))
    for path in parts:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in parts:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def cached_fraction(root: Path, split: str = "train") -> float:
    """Fraction of the parts' pages in the page cache (mincore(2) over a read-only mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, cached, total = mmap.PAGESIZE, 0, 0
    for path in (root / split).glob("part-*.parquet"):
        size = path.stat().st_size
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            pages = -(-size // page)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            cached += sum(b & 1 for b in vec.raw)
            total += pages
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return cached / max(total, 1)


def disk_read(root: Path, threads: int) -> dict:
    """GB/s of reading the parts' bytes with `threads` threads (cold when dropped first): the disk's ceiling."""
    parts = sorted((root / "train").glob("part-*.parquet"))

    def read(path: Path) -> int:
        with open(path, "rb", buffering=0) as f:
            return sum(len(chunk) for chunk in iter(lambda: f.read(8 << 20), b""))

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        size = sum(pool.map(read, parts))
    seconds = time.perf_counter() - start
    return {"gb_per_s": size / seconds / 1e9, "seconds": seconds}


def cold(root: Path, result: dict, key: str) -> None:
    """Drop the parts from the page cache and record how, and what was left cached."""
    result[f"{key}_drop"] = drop_page_cache(root)
    result[f"{key}_cached_after_drop"] = cached_fraction(root)
