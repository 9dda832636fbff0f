"""Shared test setup: GPU tests skipped without CUDA, the real Criteo rows from ../shared."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CRITEO = REPO.parent / "shared" / "data" / "criteo"  # real rows: read from ../shared, never copied


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture
def criteo_dir() -> Path:
    """The real Criteo sample rows beside the repo; skips cleanly where they are absent."""
    if not (CRITEO / "train_head_10109.txt").exists():
        pytest.skip(f"real Criteo rows not found at {CRITEO}")
    return CRITEO
