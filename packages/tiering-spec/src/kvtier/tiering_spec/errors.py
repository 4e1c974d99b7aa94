"""The error a bad configuration raises: at the bottom of the package's layers, so that
every module may raise it (it imports nothing)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` value; the message names the key."""
