"""Print the table of each nox session's wall time that `.ci/run` shows at its end.

    python tools/session_times.py TIMES.jsonl [--disk-low DISK.txt]

TIMES.jsonl holds one JSON line per session (the noxfile writes them when
KVTIER_SESSION_TIMES names the file): session, seconds, test_seconds, result. DISK.txt,
if given, holds free-disk samples in MiB, one a line; the lowest is printed beside the
first one (the peak the run used).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def table(rows: list[dict[str, object]]) -> str:
    """The rows as an aligned text table, a total line last."""
    head = ("session", "wall", "tests", "setup", "result")
    lines = [head]
    total = 0.0
    for row in rows:
        wall = float(row["seconds"])  # type: ignore[arg-type]
        tests = float(row.get("test_seconds", 0.0))  # type: ignore[arg-type]
        total += wall
        lines.append(
            (str(row["session"]), _minutes(wall), _minutes(tests), _minutes(wall - tests),
             str(row["result"]))
        )  # fmt: skip
    lines.append(("all sessions", _minutes(total), "", "", ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("times", type=Path)
    parser.add_argument("--disk-low", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    if args.times.is_file():
        rows = [json.loads(x) for x in args.times.read_text().splitlines() if x.strip()]
    print("ci: wall time per session (m:ss; tests = the session's test and benchmark runs)")
    print(table(rows) if rows else "(no session recorded a time)")
    if args.disk_low is not None and args.disk_low.is_file():
        samples = [int(x) for x in args.disk_low.read_text().split() if x.strip().isdigit()]
        if samples:
            first, low = samples[0], min(samples)
            print(
                f"ci: free disk {first / 1024:.1f} GB at the start, lowest {low / 1024:.1f} GB"
                f" (peak use {(first - low) / 1024:.1f} GB)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
