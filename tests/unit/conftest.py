"""Unit tests never write an MLflow store (integration tests start a real server instead)."""

from tests.fixtures.tracking_off import tracking_off  # noqa: F401 (an autouse fixture for this package)
