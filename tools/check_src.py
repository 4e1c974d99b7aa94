"""Source rules ruff cannot express, for ``nox -s lint``: no module under a package's
``src/`` reads the Python call stack to find vLLM's objects.

Reading frames (``sys._getframe``, ``inspect.currentframe``/``stack``, ``f_locals``,
``f_back``) ties kvtier to the names of vLLM's locals and callers: a renamed argument
upstream silently changes what kvtier finds. vLLM's objects are handed over explicitly
instead. ``ALLOWED`` names the files that still do it, each with the reason; the rule
fails on any other file, and on an allowed file that no longer needs its entry.

    python tools/check_src.py             # check the repository
    python tools/check_src.py --self-test # show that a planted frame read is caught
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAME_READ = re.compile(
    r"\bsys\._getframe\b|\binspect\.(?:currentframe|stack|getouterframes)\b"
    r"|\.f_locals\b|\.f_back\b|\.f_globals\b"
)
ALLOWED = {
    # vLLM 0.23 has no bind_kv_cache_manager: the connector finds the scheduler's
    # KVCacheManager from bind_gpu_block_pool's caller (the redesign's port removes it).
    "packages/recompute-connector/src/kvtier/recompute_connector/vllm_compat.py",
}


def frame_reads(root: Path) -> dict[str, list[int]]:
    """Files under ``root``'s ``packages/*/src`` that read stack frames, with the lines."""
    found: dict[str, list[int]] = {}
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        hits = [n for n, text in enumerate(lines, 1) if FRAME_READ.search(text.split("#")[0])]
        if hits:
            found[path.relative_to(root).as_posix()] = hits
    return found


def problems(root: Path, allowed: set[str]) -> list[str]:
    found = frame_reads(root)
    out = [
        f"{name}:{line}: reads the call stack; hand vLLM's objects over explicitly"
        for name, lines in found.items()
        if name not in allowed
        for line in lines
    ]
    out += [
        f"{name}: allowed to read the call stack but no longer does: drop it from ALLOWED"
        for name in sorted(allowed - found.keys())
    ]
    return out


def self_test() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "packages/x/src/kvtier/x"
        src.mkdir(parents=True)
        (src / "clean.py").write_text("import sys\nframe_count = 0  # no sys._getframe here\n")
        assert problems(Path(tmp), set()) == [], "a comment is not a frame read"
        (src / "bad.py").write_text("import sys\nowner = sys._getframe(1).f_locals['self']\n")
        found = problems(Path(tmp), set())
        assert len(found) == 1 and found[0].startswith("packages/x/src/kvtier/x/bad.py:2: ")
        assert problems(Path(tmp), {"packages/x/src/kvtier/x/bad.py"}) == []
        stale = problems(Path(tmp), {"packages/x/src/kvtier/x/bad.py", "packages/x/gone.py"})
        assert stale and "no longer does" in stale[0]


def main(argv: list[str]) -> int:
    if "--self-test" in argv:
        self_test()
        print("check_src: self-test passed")
        return 0
    found = problems(ROOT, ALLOWED)
    for line in found:
        print(line)
    if not found:
        print(f"check_src: no stack-frame reads under packages/*/src (allowed: {len(ALLOWED)})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
