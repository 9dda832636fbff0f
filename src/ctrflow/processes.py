"""This machine's processes: whether one that left work behind (a staging folder, a claimed trial) still
runs, and the cores this one may use."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this machine runs: it exists (signal 0 reaches it, or it belongs to
    another user) and is not a zombie (exited, not yet reaped by a parent or an init that reaps late)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS): signal 0 is all there is
        return True


def available_cores() -> int:
    """CPU cores this process may use: its affinity where the system has one (a container's or a
    scheduler's limit), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
