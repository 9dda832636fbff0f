"""Read raw files for the device parser: groups of consecutive blocks, in large host buffers.

A group is a run of the CPU engine's blocks (`blocks.plan_blocks`, same boundaries, so Parquet parts
and line accounting come out the same) read into one host buffer (pinned when the device is a GPU)
with several threads, while the previous group is parsed. Gzip files are decompressed on the CPU
(`plan_blocks`) and their blocks copied into the same buffers.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ctrflow.ingest.blocks import Block, plan_blocks, read_block

GROUP_BYTES = 256 << 20  # bytes per device buffer: large enough to amortize launches, small enough to overlap
_COPY_PIECE = 16 << 20


@dataclass
class Group:
    """Consecutive blocks of one file, their lines in `host[:size]` (a newline appended when the last line has none)."""

    file_index: int
    blocks: list[Block]
    begin: int  # byte offset (uncompressed) of the buffer's first line in the file
    size: int  # bytes in the buffer, the appended newline included
    host: "torch.Tensor"  # uint8 buffer holding the lines
    truncated: Block | None = None  # gzip stream ended early: the CPU engine's tail block, handled alone


def group_blocks(path: Path, file_index: int, block_bytes: int, group_bytes: int) -> Iterator[list[Block]]:
    """The file's blocks, in order, grouped by about `group_bytes`; a truncated gzip tail block alone."""
    group, size = [], 0
    for block in plan_blocks(path, file_index, block_bytes):
        if block.truncated:
            if group:
                yield group
            yield [block]
            return
        group.append(block)
        size += len(block.data) if block.data is not None else block.end - block.start
        if size >= group_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


class GroupReader:
    """Fills two alternating host buffers, one group ahead of the caller (a thread reads the next group)."""

    def __init__(self, torch, pinned: bool, threads: int):
        self.torch, self.pinned = torch, pinned
        self.buffers = [None, None]
        self.turn = 0
        self.copiers = ThreadPoolExecutor(max(1, threads))
        self.ahead = ThreadPoolExecutor(1)

    def close(self) -> None:
        """Stop the threads (buffers are freed with the reader)."""
        self.copiers.shutdown()
        self.ahead.shutdown()

    def groups(self, paths: dict[int, str], block_bytes: dict[int, int],
               group_bytes: int = GROUP_BYTES) -> Iterator[Group]:
        """Every group of every file (file index order as given), each read while the previous one is used."""
        plan = ((i, blocks) for i in paths for blocks in group_blocks(Path(paths[i]), i, block_bytes[i], group_bytes))
        pending = None
        for file_index, blocks in plan:
            future = self.ahead.submit(self._read, Path(paths[file_index]), file_index, blocks, self.turn)
            self.turn ^= 1
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()

    def _buffer(self, slot: int, size: int):
        buffer = self.buffers[slot]
        if buffer is None or len(buffer) < size:
            self.buffers[slot] = buffer = self.torch.empty(max(size, GROUP_BYTES + (GROUP_BYTES >> 2)),
                                                           dtype=self.torch.uint8, pin_memory=self.pinned)
        return buffer

    def _read(self, path: Path, file_index: int, blocks: list[Block], slot: int) -> Group:
        if blocks[0].truncated:
            return Group(file_index, [], blocks[0].start, 0, self._buffer(slot, 1), truncated=blocks[0])
        if blocks[0].data is not None:  # gzip: decompressed already, copy the blocks back to back
            begin, size = blocks[0].start, sum(len(b.data) for b in blocks)
            host = self._buffer(slot, size + 1)
            np.concatenate([np.frombuffer(b.data, dtype=np.uint8) for b in blocks], out=host.numpy()[:size])
            last = blocks[-1].data[-1:]
        else:
            begin, view = read_block(path, Block(file_index, 0, blocks[0].start, blocks[-1].end))
            size, last = len(view), bytes(view[-1:])
            host = self._buffer(slot, size + 1)
            self._read_range(path, begin, host.numpy()[:size])
        newline = size > 0 and last != b"\n"
        target = host.numpy()
        if newline:
            target[size] = 10
        return Group(file_index, blocks, begin, size + int(newline), host)

    def _read_range(self, path: Path, begin: int, target: np.ndarray) -> None:
        """Read the file's bytes [begin, begin + len(target)) into `target`, pieces in parallel (preadv
        releases the GIL)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            def read(lo: int) -> None:
                piece = memoryview(target[lo:lo + _COPY_PIECE])
                while len(piece):
                    n = os.preadv(fd, [piece], begin + lo)
                    if n <= 0:
                        raise OSError(f"{path}: file shrank while being read")
                    piece, lo = piece[n:], lo + n

            for job in [self.copiers.submit(read, lo) for lo in range(0, len(target), _COPY_PIECE)]:
                job.result()
        finally:
            os.close(fd)

