"""Rewrite (or check) the README configuration tables from their schemas.

Each table sits between ``<!-- schema:NAME -->`` and ``<!-- /schema -->`` in a package's
README and is generated from a ``kvtier.vllm_port.schema.Schema``: the schema is the
one place a key, its default, what it allows and what it means are written.

    python tools/readme_tables.py          # exit 1 if a README disagrees with its schema
    python tools/readme_tables.py --write  # rewrite the tables from the schemas
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (README, "module:attribute" of its schema)
TABLES = (
    ("packages/tiering-spec/README.md", "kvtier.tiering_spec.config:SPEC_SCHEMA"),
    ("packages/tiering-spec/README.md", "kvtier.tiering_spec.config:FS_TIER_SCHEMA"),
    ("packages/tiering-spec/README.md", "kvtier.tiering_spec.config:MOONCAKE_TIER_SCHEMA"),
    (
        "packages/recompute-connector/README.md",
        "kvtier.recompute_connector.config:CONNECTOR_SCHEMA",
    ),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables")
    args = parser.parse_args()
    from kvtier.vllm_port.schema import readme_table, with_readme_table

    stale = []
    for readme, target in TABLES:
        module, _, attr = target.partition(":")
        schema = getattr(importlib.import_module(module), attr)
        path = ROOT / readme
        text = path.read_text()
        if readme_table(text, schema.name) == schema.table():
            continue
        if args.write:
            path.write_text(with_readme_table(text, schema))
            print(f"{readme}: table {schema.name} rewritten")
        else:
            stale.append(f"{readme}: table {schema.name} differs from {target}")
    for line in stale:
        print(line)
    if stale:
        print("run: python tools/readme_tables.py --write")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
