"""Fixtures for the demo's tests: the tiny model from kvtier-testkit."""

from kvtier.testkit.pytest_plugin import tiny_model  # noqa: F401 - re-exported fixture
