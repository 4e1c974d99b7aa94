"""Fixtures for the recompute connector tests (tiny model, engine helpers)."""

pytest_plugins = ["kvtier.testkit.pytest_plugin"]
