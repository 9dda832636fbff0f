"""The progress bars of the passes: tqdm with rows/s on a terminal, nothing elsewhere."""

from __future__ import annotations


class _NoBar:
    """What a bar is when none is shown."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int) -> None:
        """Nothing to show."""


def progress_bar(enabled: bool, desc: str, total=None):
    """A tqdm bar with rows/s on a terminal; nothing otherwise (and no tqdm import)."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=" rows", unit_scale=True, leave=False)
