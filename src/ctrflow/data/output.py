"""Where preprocess writes: a temporary directory beside the output, renamed into place at the end.

An interrupted run leaves only `DIR.tmp-<pid>` (never a `schema.json` at `DIR`), removed by the next
run once that process is gone. The input files' content digests (for `schema.json`, `file_digest`)
are computed beside the passes in a process of its own.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ctrflow.data.parallel import start_context
from ctrflow.errors import UserError


def _remove_stale(out: Path) -> None:
    """Remove what an interrupted run (killed, so no cleanup) left: `DIR.tmp-PID` of a dead PID."""
    for leftover in out.parent.glob(f"{glob.escape(out.name)}.*-*"):
        kind, _, pid = leftover.name[len(out.name) + 1:].partition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_out_dir(out: Path) -> None:
    """Refuse to replace anything but an empty directory or an earlier preprocess output."""
    _remove_stale(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "schema.json").exists():
        raise UserError(f"{out}: exists, is not empty and is not a `ctrflow preprocess` output; "
                        "choose another --out")


def publish(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`, replacing an earlier output."""
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


class FileHasher:
    """`file_digest` of the input files, computed beside both passes in a process of its own (threads
    here would be copied into half-held states when the workers are forked; that process uses threads)."""

    def __init__(self, paths: list[Path], threads: int | None = None):
        self._receive, send = start_context().Pipe(duplex=False)
        self._proc = start_context().Process(target=_hash_files, args=([str(p) for p in paths], threads, send),
                                             daemon=True)
        self._proc.start()
        send.close()

    def result(self) -> list[str]:
        """The digests, in input order (waits for them)."""
        try:
            digests = self._receive.recv()
        except EOFError:
            raise RuntimeError(f"the file hashing process died (exit code {self._proc.exitcode})") from None
        if isinstance(digests, str):
            raise UserError(digests)
        return digests

    def __enter__(self) -> "FileHasher":
        return self

    def __exit__(self, *exc) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()
        self._receive.close()


def _hash_files(paths: list[str], threads: int | None, send) -> None:
    try:
        send.send(file_digests([Path(p) for p in paths], threads))
    except OSError as err:
        send.send(f"{err.filename}: cannot read ({err.strerror})")


DIGEST_ALGORITHM = "sha256-tree-64MiB"
PIECE_BYTES = 64 << 20
_READ_BYTES = 4 << 20


def file_digest(path: Path, threads: int | None = None) -> str:
    """The file's content digest as `schema.json` records it: `"sha256-tree-64MiB:<64 hex digits>"`.

    Algorithm (to recompute it elsewhere): cut the file into pieces of 64 MiB (2**26 bytes; the last
    piece is shorter, an empty file has no piece); take each piece's raw 32-byte sha256; the digest is
    the sha256 (hex) of those raw digests concatenated in file order. In Python:
    `sha256(b"".join(sha256(piece).digest() for piece in pieces)).hexdigest()`. Pieces are hashed by
    `threads` threads at once (default: the usable cores), so it is not bound to one core."""
    return file_digests([path], threads)[0]


def file_digests(paths: list[Path], threads: int | None = None) -> list[str]:
    """`file_digest` of each path, in order; every piece of every file shares one thread pool."""
    pieces = [(i, path, at) for i, path in enumerate(paths)
              for at in range(0, os.stat(path).st_size, PIECE_BYTES)]
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    with ThreadPoolExecutor(max(1, min(threads or 1, len(pieces) or 1))) as pool:
        hashed = list(pool.map(lambda piece: _piece_digest(piece[1], piece[2]), pieces))
    tops = [hashlib.sha256() for _ in paths]
    for (i, _, _), digest in zip(pieces, hashed):
        tops[i].update(digest)
    return [f"{DIGEST_ALGORITHM}:{top.hexdigest()}" for top in tops]


def _piece_digest(path: Path, at: int) -> bytes:
    """Raw sha256 of the 64 MiB piece at offset `at`, read in 4 MB slices (bounded memory per thread)."""
    digest = hashlib.sha256()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        left = PIECE_BYTES
        while left:
            n = os.preadv(fd, [view[:min(left, _READ_BYTES)]], at + PIECE_BYTES - left)
            if n == 0:
                break
            digest.update(view[:n])  # hashlib releases the GIL on large buffers: the threads run in parallel
            left -= n
    finally:
        os.close(fd)
    return digest.digest()
