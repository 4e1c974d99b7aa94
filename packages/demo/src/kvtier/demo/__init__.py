"""kvtier-demo: kvtier at work on a preemption-heavy and a prefix-heavy workload.

Run it with ``python -m kvtier.demo`` (or ``nox -s demo`` from the repository).
"""

from kvtier.demo.__about__ import __version__

__all__ = ["__version__"]
