"""Configuration schemas: one declaration per configuration gives its validation, the
list of keys it knows and the README table that documents it.

A :class:`Schema` is a tuple of :class:`Key` rows. Each key names its kind (what a
value must be, and how the README says so), its default and what it means::

    TIER = Schema(
        "fs-tier",
        (
            Key("root_dir", Text(), "directory for the block files", REQUIRED),
            Key("n_read_threads", Int(1, 256), "I/O threads for promotions", 16),
        ),
    )
    values = TIER.parse(entry, where="secondary_tiers[0]")  # defaults filled in
    TIER.names()                                            # the known keys
    TIER.table()                                            # the README's table

A README holds each generated table between ``<!-- schema:NAME -->`` and
``<!-- /schema -->``; :func:`readme_table` reads it back and
:func:`with_readme_table` writes it, so a test can fail when the two disagree and a
tool can rewrite them. What depends on several keys at once (two keys that exclude
each other, a directory to create) stays in the configuration's own parser, after
:meth:`Schema.parse`.

Errors name the key with its path, the value given and what is allowed, and are of
the schema's error class (a ``ValueError``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""The default of a key that must be given."""


class Kind(Protocol):
    """What a key's value must be."""

    def parse(self, key: str, value: Any) -> Any:
        """``value`` checked (and normalized); raises ``ValueError`` naming ``key``."""
        ...

    def allowed(self) -> str:
        """The README's words for the values allowed."""
        ...


@dataclass(frozen=True)
class Int:
    """A whole number in ``[minimum, maximum]``: JSON integers, and integral floats
    (``8e9``, as JSON and YAML like to write big numbers); not bools or strings."""

    minimum: int = 1
    maximum: int | None = None

    def parse(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"{key} must be {self._what()}, got {value!r} ({type(value).__name__})"
            )
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{key} must be {self._what()}, got {value!r} (not whole)")
            value = int(value)
        if value < self.minimum or (self.maximum is not None and value > self.maximum):
            raise ValueError(f"{key} must be {self._what()}, got {value!r}")
        return int(value)

    def _what(self) -> str:
        upper = f" and <= {self.maximum}" if self.maximum is not None else ""
        return f"an integer >= {self.minimum}{upper}"

    def allowed(self) -> str:
        if self.maximum is not None:
            return f"integer {self.minimum}\u2013{self.maximum}"  # an en dash
        return f"integer ≥ {self.minimum}"


@dataclass(frozen=True)
class Bool:
    """A JSON boolean. A string is refused even when it reads "false": ``bool("false")``
    is true, so a configuration that quotes its booleans would mean the opposite."""

    def parse(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        raise ValueError(
            f"{key} must be a JSON boolean, true or false (not a string), "
            f"got {value!r} ({type(value).__name__})"
        )

    def allowed(self) -> str:
        return "JSON boolean"


@dataclass(frozen=True)
class Choice:
    """One of ``values``; with ``fold_case`` a string is compared in upper case."""

    values: tuple[str, ...]
    fold_case: bool = False

    def parse(self, key: str, value: Any) -> str:
        seen = value.upper() if self.fold_case and isinstance(value, str) else value
        if seen not in self.values:
            raise ValueError(f"{key} must be one of {', '.join(self.values)}, got {value!r}")
        return str(seen)

    def allowed(self) -> str:
        return ", ".join(f"`{v}`" for v in self.values)


@dataclass(frozen=True)
class Text:
    """A string; with ``nonempty`` one that is not blank."""

    nonempty: bool = True
    words: str = ""  # what the string is, for errors and the README

    def parse(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or (self.nonempty and not value.strip()):
            what = self.words or ("a non-empty string" if self.nonempty else "a string")
            raise ValueError(f"{key} must be {what}, got {value!r}")
        return value

    def allowed(self) -> str:
        return self.words or ("non-empty string" if self.nonempty else "string")


@dataclass(frozen=True)
class Check:
    """A value only ``check`` can judge: ``check(key, value)`` returns it (normalized) or
    raises ``ValueError``; ``words`` say in the README what it accepts."""

    check: Callable[[str, Any], Any]
    words: str

    def parse(self, key: str, value: Any) -> Any:
        return self.check(key, value)

    def allowed(self) -> str:
        return self.words


def accept(key: str, value: Any) -> Any:
    """A :class:`Check` for keys another component validates (vLLM's own keys)."""
    return value


@dataclass(frozen=True)
class Key:
    """One configuration key.

    Attributes:
        name: the key.
        kind: what its value must be.
        meaning: what it does (the README's words).
        default: its value when absent or null; :data:`REQUIRED` if it must be given.
        default_words: the README's words for the default, where the value alone would
            mislead (a default computed at start-up); derived from ``default`` if empty.
        allowed_words: the README's words for the allowed values, where they say more
            than the kind does; the kind's words if empty.
    """

    name: str
    kind: Kind
    meaning: str
    default: Any = None
    default_words: str = ""
    allowed_words: str = ""

    def default_text(self) -> str:
        if self.default_words:
            return self.default_words
        if self.default is REQUIRED:
            return "required"
        if self.default is None:
            return "—"
        if isinstance(self.default, bool):
            return f"`{str(self.default).lower()}`"
        if isinstance(self.default, str):
            return f"`{self.default}`"
        return f"`{self.default}`"


COLUMNS = ("key", "meaning", "allowed", "default")


@dataclass(frozen=True)
class Schema:
    """The keys of one configuration, in README order.

    Attributes:
        name: the README marker's name (``<!-- schema:NAME -->``).
        keys: the keys.
        error: the class of the errors ``parse`` raises (a ``ValueError``).
        columns: the README table's columns, from ``key``, ``meaning``, ``allowed``,
            ``default``.
    """

    name: str
    keys: tuple[Key, ...]
    error: type[ValueError] = ValueError
    columns: tuple[str, ...] = COLUMNS

    def __post_init__(self) -> None:
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"schema {self.name}: a key is declared twice: {names}")
        if not set(self.columns) <= set(COLUMNS) or self.columns[0] != "key":
            raise ValueError(f"schema {self.name}: columns must start with 'key', from {COLUMNS}")

    def names(self) -> frozenset[str]:
        """The keys this configuration knows."""
        return frozenset(k.name for k in self.keys)

    def unknown(self, raw: Mapping[str, Any]) -> list[str]:
        """The keys of ``raw`` this configuration does not know, sorted."""
        return sorted(str(k) for k in raw if k not in self.names())

    def parse(self, raw: Mapping[str, Any], where: str = "") -> dict[str, Any]:
        """Every key's value in ``raw`` checked, defaults filled in for absent and null
        ones. Raises the schema's error naming ``where.key``. Unknown keys are the
        caller's to judge (:meth:`unknown`): some configurations warn, some refuse."""
        out: dict[str, Any] = {}
        for key in self.keys:
            path = f"{where}.{key.name}" if where else key.name
            value = raw.get(key.name)
            if value is None:
                if key.default is REQUIRED:
                    allowed = key.allowed_words or key.kind.allowed()
                    raise self.error(f"{path} is required: {key.meaning} ({allowed})")
                out[key.name] = key.default
                continue
            try:
                out[key.name] = key.kind.parse(path, value)
            except self.error:
                raise
            except ValueError as exc:
                raise self.error(str(exc)) from None
        return out

    def table(self) -> str:
        """The README table of these keys (markdown, no trailing newline)."""
        head = "| " + " | ".join(self.columns) + " |"
        rule = "| " + " | ".join("---" for _ in self.columns) + " |"
        rows = [head, rule]
        for key in self.keys:
            cells = {
                "key": f"`{key.name}`",
                "meaning": key.meaning,
                "allowed": key.allowed_words or key.kind.allowed(),
                "default": key.default_text(),
            }
            rows.append("| " + " | ".join(cells[c] for c in self.columns) + " |")
        return "\n".join(rows)


def _markers(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- schema:{re.escape(name)} -->\n)(.*?)(\n<!-- /schema -->)", re.DOTALL)


def readme_table(text: str, name: str) -> str | None:
    """The table a README holds between the markers of schema ``name``, or None."""
    found = _markers(name).search(text)
    return None if found is None else found.group(2)


def with_readme_table(text: str, schema: Schema) -> str:
    """``text`` with the table between ``schema``'s markers rewritten from the schema.
    Raises ``ValueError`` if the README has no such markers."""
    pattern = _markers(schema.name)
    if pattern.search(text) is None:
        raise ValueError(f"no <!-- schema:{schema.name} --> ... <!-- /schema --> block")
    return pattern.sub(lambda m: m.group(1) + schema.table() + m.group(3), text, count=1)
