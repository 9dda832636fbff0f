"""Shared test setup: GPU tests skipped without CUDA, whole files to parallel workers, the real
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

# The files whose tests read the one local pipeline run (tests/integration/conftest.py): one worker
# takes them all, so that run is made once.
PIPELINE_RUN_FILES = {"tests/integration/test_pipeline_local.py", "tests/integration/test_mlflow_ui.py",
                      "tests/integration/test_container_pipeline.py"}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`: a worker takes a whole file (its module fixtures are built once), and the
    files in PIPELINE_RUN_FILES together (the pipeline run is made once)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByFileSharingThePipelineRun(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "pipeline-run" if path in PIPELINE_RUN_FILES else path

    return ByFileSharingThePipelineRun(config, log)


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
