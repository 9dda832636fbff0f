"""Shared test setup: GPU tests skipped without CUDA, the real Criteo rows beside the repository, one
intra-op thread on request. Helpers that tests share live in the `tests.fixtures` package."""

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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): on a
    machine of few cores, more threads spin against each other."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
