"""Whole steps and multi-process parity runs (gloo), tracking off: slower than unit tests, and
starting no server."""

from tests.fixtures.tracking_off import tracking_off  # noqa: F401 (an autouse fixture for this package)
