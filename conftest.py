"""The test sessions' file order: the longest test files start first.

``nox -s tests`` (and the e2e and pd sessions) hand whole test files to two pytest-xdist
workers (``--dist loadfile``), in the order collected (``--no-loadscope-reorder``: xdist
would otherwise start the files with the most tests first, which leaves the few-test but
long multi-process engine files for last, one on each worker after everything else is
done). Here a file that starts several engine processes (marked ``heavy``) comes first,
then a file that runs a vLLM engine (marked ``e2e``), then the rest, each group in the
order collected, so the short files fill in at the end.
"""

from __future__ import annotations

import pytest


def _rank(item: pytest.Item) -> int:
    if item.get_closest_marker("heavy") is not None:
        return 0
    if item.get_closest_marker("e2e") is not None:
        return 1
    return 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A file is ranked by its heaviest test, so its tests stay together.
    ranks: dict[str, int] = {}
    for item in items:
        path = str(item.path)
        ranks[path] = min(ranks.get(path, 2), _rank(item))
    items.sort(key=lambda item: ranks[str(item.path)])  # stable: collected order within
