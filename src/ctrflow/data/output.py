"""Where preprocess writes: a temporary directory beside the output, renamed into place at the end.

An interrupted run leaves only `DIR.tmp-<pid>` (never a `schema.json` at `DIR`), removed by the next
run once that process is gone. The input files' sha256 (for `schema.json`) is computed beside the
passes in a process of its own.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
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
    """sha256 of the input files, computed beside both passes in a process of its own (a thread here
    would be copied into half-held states when the workers are forked)."""

    def __init__(self, paths: list[Path]):
        self._receive, send = start_context().Pipe(duplex=False)
        self._proc = start_context().Process(target=_hash_files, args=([str(p) for p in paths], send), daemon=True)
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


def _hash_files(paths: list[str], send) -> None:
    try:
        send.send([sha256_file(Path(p)) for p in paths])
    except OSError as err:
        send.send(f"{err.filename}: cannot read ({err.strerror})")


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex), read in 4 MB pieces."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 22)  # reused: no mapping of the whole file, so RSS stays flat
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])  # hashlib releases the GIL: the workers keep going
    return digest.hexdigest()
