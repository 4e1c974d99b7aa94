"""The README's configuration tables and the keys config.py accepts are the same
keys: a key added to one and not the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.tiering_spec import config

README = Path(__file__).resolve().parents[2] / "README.md"


def key_tables() -> dict[str, set[str]]:
    """Each ``| key | ...`` table of the README, by the first line of the paragraph
    above it: the names in backticks in its first column."""
    lines = README.read_text().splitlines()
    tables: dict[str, set[str]] = {}
    keys: set[str] | None = None
    for i, line in enumerate(lines):
        if line.startswith("| key |"):
            start = i - 2
            while start > 0 and lines[start - 1].strip():
                start -= 1
            keys = tables.setdefault(lines[start], set())
        elif keys is not None and line.startswith("|"):
            if not line.startswith("| ---"):
                keys.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
        else:
            keys = None
    return tables


def table_after(heading: str) -> set[str]:
    found = [keys for title, keys in key_tables().items() if heading in title]
    assert len(found) == 1, f"one table after a line with {heading!r}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize(
    ("heading", "schema"),
    [
        ("## Configuration (`kv_connector_extra_config`)", set(config.KNOWN_KEYS)),
        ("An `fs` tier entry", set(config._FS_KEYS)),
        ("A `mooncake` tier entry", set(config._MOONCAKE_KEYS)),
    ],
    ids=["top-level", "fs", "mooncake"],
)
def test_each_readme_table_lists_exactly_the_keys_config_accepts(
    heading: str, schema: set[str]
) -> None:
    documented = table_after(heading)
    assert not schema - documented, f"accepted but not in the README: {sorted(schema - documented)}"
    assert not documented - schema, f"in the README but refused: {sorted(documented - schema)}"
