"""Input files of preprocessing cut into blocks of whole lines.

Files may be gzip. Blocks are cut on newline boundaries so every row keeps an exact line number:
plain files are cut by byte range (each worker reads its own range), gzip files are decompressed
in order by one reader.
"""

from __future__ import annotations

import mmap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ctrflow.contract.formats.files import is_gzip
from ctrflow.errors import UserError

_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Block:
    """A run of whole lines of one input file: a byte range to read, or (gzip) the lines themselves."""

    file_index: int
    index: int  # order within its file
    start: int  # uncompressed byte offset where the block's range begins
    end: int = 0  # plain files: the worker reads the lines starting in [start, end)
    data: bytes | None = None  # gzip: decompressed whole lines, read in order by the main process
    truncated: bool = False  # gzip stream ended early: `data` is the incomplete last line (may be empty)


def plan_blocks(path: Path, file_index: int, block_bytes: int) -> Iterator[Block]:
    """The blocks of one file, in order."""
    if is_gzip(path):
        yield from _gzip_blocks(path, file_index, block_bytes)
        return
    size = path.stat().st_size
    for index, start in enumerate(range(0, size, block_bytes)):
        yield Block(file_index, index, start, min(start + block_bytes, size))


def read_block(path: Path, block: Block) -> tuple[int, bytes | memoryview]:
    """(byte offset of the first line, the lines starting inside the block's range, newlines included)."""
    if block.data is not None:
        return block.start, block.data
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # no copy: pyarrow parses in place
    size = len(mapped)
    begin = block.start
    if begin > 0:  # a line starts at `start` only when the byte before it is a newline
        newline = mapped.find(b"\n", begin - 1)
        begin = size if newline < 0 else newline + 1
    if begin >= block.end:
        return begin, b""
    newline = mapped.find(b"\n", block.end - 1)  # the last line starts inside the range: it belongs here
    stop = size if newline < 0 else newline + 1
    return begin, memoryview(mapped)[begin:stop]


def _gzip_blocks(path: Path, file_index: int, block_bytes: int) -> Iterator[Block]:
    """Decompress (multi-member) gzip, cutting blocks after a newline; a truncated stream ends with a marker."""
    buf = bytearray()
    offset, index = 0, 0
    decomp = zlib.decompressobj(31)
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            try:
                while chunk:
                    buf += decomp.decompress(chunk)
                    chunk = b""
                    if decomp.eof and decomp.unused_data:  # concatenated gzip members
                        chunk, decomp = decomp.unused_data, zlib.decompressobj(31)
            except zlib.error as err:
                raise UserError(f"{path}: corrupt gzip data near uncompressed byte {offset + len(buf)} ({err})")
            while len(buf) >= block_bytes and (cut := buf.find(b"\n", block_bytes - 1) + 1):
                yield Block(file_index, index, offset, data=bytes(buf[:cut]))
                offset, index = offset + cut, index + 1
                del buf[:cut]
    if decomp.eof:
        if buf:
            yield Block(file_index, index, offset, data=bytes(buf))
        return
    if cut := buf.rfind(b"\n") + 1:
        yield Block(file_index, index, offset, data=bytes(buf[:cut]))
        offset, index = offset + cut, index + 1
    yield Block(file_index, index, offset, data=bytes(buf[cut:]), truncated=True)


def truncation_message(path: Path, line: int, tail: bytes) -> str:
    """The one-line error for a gzip stream that ends early."""
    where = f"line {line}" if tail else f"after line {line}"
    return f"{path}: {where}: truncated gzip file (the compressed stream ends early)"


_SAMPLE_BYTES = 1 << 20


def bytes_per_block(path: Path, chunk_rows: int) -> int:
    """Bytes per block for about `chunk_rows` lines, from the file's first megabyte (decompressed)."""
    first = next(plan_blocks(path, 0, _SAMPLE_BYTES), None) if is_gzip(path) else None
    if first is not None and first.data is not None:
        sample = first.data[:_SAMPLE_BYTES]
    else:
        with open(path, "rb") as f:
            sample = f.read(_SAMPLE_BYTES)
    per_row = len(sample) / max(1, sample.count(b"\n")) if sample else 256
    return max(1 << 12, int(chunk_rows * per_row))
