"""The README's configuration tables are the schemas' tables: a key, a default or an
allowed value changed in one and not the other fails here
(``python tools/readme_tables.py --write`` rewrites the README from the schemas)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tiering_spec import config
from kvtier.vllm_port.schema import Schema, readme_table

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    "schema",
    [config.SPEC_SCHEMA, config.FS_TIER_SCHEMA, config.MOONCAKE_TIER_SCHEMA],
    ids=lambda s: s.name,
)
def test_each_readme_table_is_its_schema(schema: Schema) -> None:
    documented = readme_table(README.read_text(), schema.name)
    assert documented is not None, f"README has no <!-- schema:{schema.name} --> table"
    assert documented == schema.table(), "run: python tools/readme_tables.py --write"


def test_the_schemas_are_what_the_parser_knows() -> None:
    assert config.SPEC_SCHEMA.names() == config.KNOWN_KEYS
    entry = {"type": "fs", "root_dir": "/tmp/x"}
    parsed = config.parse_fs_tier(entry, "t", check_paths=False)
    defaults = config.FS_TIER_SCHEMA.parse(entry, "t")
    for key in ("n_read_threads", "n_write_threads", "eviction_policy", "locality"):
        assert getattr(parsed, key) == defaults[key], key
    with pytest.raises(config.ConfigError, match=r"t: unknown key\(s\) \['colour'\]"):
        config.parse_fs_tier({**entry, "colour": 1}, "t", check_paths=False)
