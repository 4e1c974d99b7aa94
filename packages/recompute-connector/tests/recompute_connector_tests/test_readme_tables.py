"""The README's configuration table is the connector's schema
(``python tools/readme_tables.py --write`` rewrites it)."""

from __future__ import annotations

from pathlib import Path

from kvtier.recompute_connector.config import CONNECTOR_SCHEMA, KNOWN_KEYS
from kvtier.vllm_port.schema import readme_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_is_the_schema() -> None:
    documented = readme_table(README.read_text(), CONNECTOR_SCHEMA.name)
    assert documented is not None, "README has no <!-- schema:recompute-connector --> table"
    assert documented == CONNECTOR_SCHEMA.table(), "run: python tools/readme_tables.py --write"
    assert CONNECTOR_SCHEMA.names() == KNOWN_KEYS
