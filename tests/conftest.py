"""Shared test setup: GPU tests skipped without CUDA, tests grouped for parallel workers, the real
Criteo rows beside the repository, one intra-op thread on request. Helpers that tests share live in the
`tests.fixtures` package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CRITEO = REPO.parent / "shared" / "data" / "criteo"  # real rows: read from ../shared, never copied

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers already fill the cores: more intra-op threads in a worker, or in a step it starts,
    # spin against the other workers' (torch reads this when it is first imported, after this file).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

SHARED_SESSION_FIXTURES = ("pipeline_run",)  # too costly to build once per parallel worker


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (`--dist loadgroup`)
def pytest_collection_modifyitems(config, items):
    group_by_file(items)
    skip_gpu_tests_without_cuda(items)


def group_by_file(items) -> None:
    """One xdist group per test file, so a file's module fixtures are built once; the tests that use a
    costly session fixture share one group, so it is built once too."""
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            shared = set(SHARED_SESSION_FIXTURES) & set(item.fixturenames)
            group = "shared-session" if shared else item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(group))


def skip_gpu_tests_without_cuda(items) -> None:
    """A skip on every `gpu` test where torch sees no CUDA device."""
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
