"""Schemas: validation, known keys and README tables from one declaration."""

from __future__ import annotations

import pytest

from kvtier.vllm_port.schema import (
    REQUIRED,
    Bool,
    Check,
    Choice,
    Int,
    Key,
    Schema,
    Text,
    readme_table,
    with_readme_table,
)


class BadConfig(ValueError):
    pass


def _even(key: str, value: object) -> int:
    if not isinstance(value, int) or value % 2:
        raise ValueError(f"{key} must be an even integer, got {value!r}")
    return value


SCHEMA = Schema(
    "demo",
    (
        Key("root", Text(), "where files go", REQUIRED),
        Key("threads", Int(1, 8), "I/O threads", 4),
        Key("events", Bool(), "publish events", True),
        Key("locality", Choice(("LOCAL", "REMOTE"), fold_case=True), "reported", "LOCAL"),
        Key("pairs", Check(_even, "even integer"), "pairs of things", default_words="none"),
    ),
    error=BadConfig,
)


def test_parse_fills_defaults_and_normalizes() -> None:
    assert SCHEMA.parse({"root": "/x", "threads": 8.0, "locality": "remote"}) == {
        "root": "/x",
        "threads": 8,
        "events": True,
        "locality": "REMOTE",
        "pairs": None,
    }
    assert SCHEMA.parse({"root": "/x", "threads": None})["threads"] == 4  # null: the default


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, r"t\.root is required: where files go \(non-empty string\)"),
        ({"root": "  "}, r"t\.root must be a non-empty string"),
        ({"root": "/x", "threads": 9}, r"t\.threads must be an integer >= 1 and <= 8, got 9"),
        ({"root": "/x", "threads": "4"}, r"t\.threads must be an integer .*\(str\)"),
        ({"root": "/x", "threads": True}, r"t\.threads must be an integer"),
        ({"root": "/x", "threads": 2.5}, r"t\.threads must be an integer"),
        ({"root": "/x", "events": "false"}, r"t\.events must be a JSON boolean"),
        ({"root": "/x", "locality": "MARS"}, r"t\.locality must be one of LOCAL, REMOTE"),
        ({"root": "/x", "pairs": 3}, r"t\.pairs must be an even integer, got 3"),
    ],
)
def test_errors_name_the_key_and_what_is_allowed(raw: dict, message: str) -> None:
    with pytest.raises(BadConfig, match=message):
        SCHEMA.parse(raw, "t")


def test_known_and_unknown_keys() -> None:
    assert SCHEMA.names() == {"root", "threads", "events", "locality", "pairs"}
    assert SCHEMA.unknown({"root": 1, "b": 2, "a": 3}) == ["a", "b"]
    with pytest.raises(ValueError, match="declared twice"):
        Schema("twice", (Key("a", Bool(), ""), Key("a", Bool(), "")))


def test_the_readme_table_round_trips() -> None:
    table = SCHEMA.table()
    assert table.splitlines()[:3] == [
        "| key | meaning | allowed | default |",
        "| --- | --- | --- | --- |",
        "| `root` | where files go | non-empty string | required |",
    ]
    assert "| `threads` | I/O threads | integer 1\u20138 | `4` |" in table
    assert "| `events` | publish events | JSON boolean | `true` |" in table
    assert "| `pairs` | pairs of things | even integer | none |" in table
    readme = "# T\n\n<!-- schema:demo -->\n| stale |\n<!-- /schema -->\n\nafter\n"
    assert readme_table(readme, "demo") == "| stale |"
    assert readme_table(readme, "other") is None
    fresh = with_readme_table(readme, SCHEMA)
    assert readme_table(fresh, "demo") == table
    assert fresh.endswith("<!-- /schema -->\n\nafter\n")
    with pytest.raises(ValueError, match="no <!-- schema:demo -->"):
        with_readme_table("no markers", SCHEMA)
