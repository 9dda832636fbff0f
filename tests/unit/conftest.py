"""Unit tests never write an MLflow store (integration tests start a real server instead)."""

import pytest


@pytest.fixture(scope="package", autouse=True)
def _tracking_off():
    # Package scope: set before any module-scoped fixture runs a step.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", "none")
        yield
