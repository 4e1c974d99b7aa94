"""Each package's version moves on its own; ``nox -s lint`` checks that it does.

Every package under ``packages/`` carries its version in ``src/kvtier/<name>/__about__.py``
and its history in ``CHANGELOG.md``, one section per version, newest first::

    ## 0.2.0 — unreleased       (at most one, on top: what the next release ships)
    ## 0.1.0 — 2026-12-02       (released: dated)

``check`` fails on:

* a version in ``__about__.py`` that is not the changelog's top section;
* a section heading that is neither dated nor ``unreleased``, a second ``unreleased``
  section, or versions and dates that do not go down the page;
* a pin on a sibling that is not a range (``>=lower,<upper``) or that leaves out the
  sibling's version in this tree (the wheels CI installs would not resolve);
* a released package whose ``src/`` changed in a commit after the one that dated its
  top section: that change would ship under a version that says otherwise (open an
  ``unreleased`` section with ``bump``). Needs the git history; skipped, with a line,
  where there is none.

``bump`` opens the next version of one package (an ``unreleased`` section and
``__about__.py``) and moves the siblings' pins on it to ``>=X.Y,<next`` where the old
range leaves the new version out; ``release`` dates a package's unreleased section.

    python tools/versions.py check
    python tools/versions.py bump kvtier-blockpool 0.2.0
    python tools/versions.py release kvtier-blockpool [--date 2026-12-02]
    python tools/versions.py --self-test     # each planted offence is caught
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
HEADING = re.compile(r"^## (?P<version>\S+) — (?P<when>unreleased|\d{4}-\d{2}-\d{2})\s*$")
ABOUT = re.compile(r'^__version__ = "(?P<version>[^"]+)"[ \t]*$', re.MULTILINE)


@dataclass
class Section:
    version: str
    when: str  # "unreleased" or an ISO date
    line: int


@dataclass
class Package:
    dist: str
    folder: Path
    about: Path
    pyproject: dict

    @property
    def changelog(self) -> Path:
        return self.folder / "CHANGELOG.md"

    def version(self) -> str:
        found = ABOUT.search(self.about.read_text(encoding="utf-8"))
        return found["version"] if found else ""

    def sections(self) -> list[Section]:
        out: list[Section] = []
        lines = self.changelog.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if line.startswith("## "):
                found = HEADING.match(line)
                when = found["when"] if found else ""
                out.append(Section(found["version"] if found else line[3:], when, number))
        return out

    def requirements(self) -> list[Requirement]:
        project = self.pyproject["project"]
        texts = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            texts += extra
        return [Requirement(text) for text in texts]


def packages(root: Path) -> dict[str, Package]:
    found: dict[str, Package] = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        about = pyproject.parent / data["tool"]["hatch"]["version"]["path"]
        dist = data["project"]["name"]
        found[dist] = Package(dist, pyproject.parent, about, data)
    return found


def _git(root: Path, *args: str) -> str | None:
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _changes_after_release(root: Path, pkg: Package, top: Section) -> list[str] | None:
    """Commits after the one that dated ``top`` that change ``pkg``'s ``src/`` (None
    when the history cannot tell)."""
    heading = f"## {top.version} — {top.when}"
    changelog = pkg.changelog.relative_to(root).as_posix()
    dated = _git(root, "log", "-1", "--format=%H", "-S", heading, "--", changelog)
    if not dated or not dated.strip():
        return None
    src = (pkg.folder / "src").relative_to(root).as_posix()
    later = _git(root, "log", "--format=%h %s", f"{dated.strip()}..HEAD", "--", src)
    return None if later is None else [line for line in later.splitlines() if line]


def problems(root: Path, *, history: bool = True) -> list[str]:
    out: list[str] = []
    pkgs = packages(root)
    versions = {dist: pkg.version() for dist, pkg in pkgs.items()}
    for dist, pkg in pkgs.items():
        where = pkg.changelog.relative_to(root).as_posix()
        try:
            Version(versions[dist])
        except InvalidVersion:
            out.append(f"{pkg.about.relative_to(root)}: no valid __version__")
            continue
        sections = pkg.sections()
        if not sections:
            out.append(f"{where}: no '## <version> — <date or unreleased>' section")
            continue
        for section in sections:
            if not section.when:
                out.append(
                    f"{where}:{section.line}: a heading must read "
                    "'## <version> — unreleased' or '## <version> — YYYY-MM-DD'"
                )
        sections = [s for s in sections if s.when]
        if sections and sections[0].version != versions[dist]:
            out.append(
                f"{where}:{sections[0].line}: top section is {sections[0].version}, "
                f"__about__.py says {versions[dist]}"
            )
        for section in sections[1:]:
            if section.when == "unreleased":
                out.append(f"{where}:{section.line}: only the top section may be unreleased")
        for newer, older in itertools.pairwise(sections):
            if Version(older.version) >= Version(newer.version):
                out.append(
                    f"{where}:{older.line}: {older.version} is not older than {newer.version}"
                )
            if "unreleased" not in (newer.when, older.when) and older.when > newer.when:
                out.append(f"{where}:{older.line}: dated after the section above it")
        for req in pkg.requirements():
            if req.name not in pkgs:
                continue
            ops = {spec.operator for spec in req.specifier}
            if ops != {">=", "<"} or len(req.specifier) != 2:
                out.append(
                    f"{pkg.folder.name}/pyproject.toml: {req} must be a range '>=lower,<upper'"
                )
            elif not req.specifier.contains(versions[req.name], prereleases=True):
                out.append(
                    f"{pkg.folder.name}/pyproject.toml: {req} leaves out {req.name} "
                    f"{versions[req.name]} (python tools/versions.py bump moves pins)"
                )
        if history and sections and sections[0].when != "unreleased":
            later = _changes_after_release(root, pkg, sections[0])
            if later:
                out.append(
                    f"{where}: {dist} {sections[0].version} was released, yet its src/ "
                    f"changed since in {len(later)} commit(s) (first: {later[-1]}); "
                    f"open the next version: python tools/versions.py bump {dist} X.Y.Z"
                )
    return out


def _next_range(version: Version) -> str:
    """The pin a sibling gets on ``version``: its release line (0.x: the minor)."""
    major, minor = version.major, version.minor
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    return f">={major}.{minor},<{upper}"


def bump(root: Path, dist: str, new: str) -> list[str]:
    """Open ``new`` as ``dist``'s unreleased version; move sibling pins that leave it out."""
    pkgs = packages(root)
    pkg = pkgs[dist]
    if Version(new) <= Version(pkg.version()):
        raise SystemExit(f"{dist}: {new} is not newer than {pkg.version()}")
    sections = [s for s in pkg.sections() if s.when]
    if sections and sections[0].when == "unreleased":
        raise SystemExit(f"{dist}: {sections[0].version} is still unreleased; release it first")
    text = pkg.changelog.read_text(encoding="utf-8")
    at = text.index("\n## ") + 1 if "\n## " in text else len(text)
    pkg.changelog.write_text(f"{text[:at]}## {new} — unreleased\n\n{text[at:]}", "utf-8")
    about = pkg.about.read_text(encoding="utf-8")
    pkg.about.write_text(ABOUT.sub(f'__version__ = "{new}"', about), "utf-8")
    moved: list[str] = []
    for other in pkgs.values():
        path = other.folder / "pyproject.toml"
        text = path.read_text(encoding="utf-8")
        for req in other.requirements():
            if req.name == dist and not req.specifier.contains(new, prereleases=True):
                pin = f"{req.name}{_next_range(Version(new))}"
                quoted = re.compile(rf'"{re.escape(req.name)}(?![\w.-])[^";]*(?P<rest>;[^"]*)?"')
                text = quoted.sub(lambda m, pin=pin: f'"{pin}{m["rest"] or ""}"', text)
                moved.append(f"{other.dist}: {req} -> {pin}")
        path.write_text(text, encoding="utf-8")
    return moved


def release(root: Path, dist: str, date: str) -> None:
    pkg = packages(root)[dist]
    sections = [s for s in pkg.sections() if s.when]
    if not sections or sections[0].when != "unreleased":
        raise SystemExit(f"{dist}: nothing unreleased to release")
    lines = pkg.changelog.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[sections[0].line - 1] = f"## {sections[0].version} — {date}\n"
    pkg.changelog.write_text("".join(lines), encoding="utf-8")


def self_test() -> None:
    """Plant each offence in a copy of the packages' metadata; each must be reported."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)

        def fresh() -> Path:
            root = base / f"r{len(list(base.iterdir()))}"
            for pkg in packages(ROOT).values():
                dest = root / pkg.folder.relative_to(ROOT)
                (dest / pkg.about.relative_to(pkg.folder)).parent.mkdir(parents=True)
                for path in (pkg.about, pkg.changelog, pkg.folder / "pyproject.toml"):
                    shutil.copy(path, dest / path.relative_to(pkg.folder))
            return root

        def edit(path: Path, old: str, new: str) -> None:
            text = path.read_text(encoding="utf-8")
            assert old in text, (path, old)
            path.write_text(text.replace(old, new, 1), encoding="utf-8")

        clean = fresh()
        assert problems(clean, history=False) == [], problems(clean, history=False)
        pool = "packages/blockpool"
        cases = {
            "version mismatch": lambda r: edit(
                r / pool / "src/kvtier/blockpool/__about__.py", '"', '"9.'
            ),
            "bad heading": lambda r: edit(r / pool / "CHANGELOG.md", "\n## ", "\n## v? "),
            "exact pin": lambda r: edit(
                r / "packages/demo/pyproject.toml",
                "kvtier-testkit>=0.1,<0.2",
                "kvtier-testkit==0.1.0",
            ),
            "pin leaves out": lambda r: edit(
                r / "packages/demo/pyproject.toml",
                "kvtier-testkit>=0.1,<0.2",
                "kvtier-testkit>=0.3,<0.4",
            ),
        }
        for name, plant in cases.items():
            root = fresh()
            plant(root)
            assert problems(root, history=False), f"not caught: {name}"
        root = fresh()
        top = packages(root)["kvtier-blockpool"]
        first = top.version()
        if next(s for s in top.sections() if s.when).when == "unreleased":
            release(root, "kvtier-blockpool", "2999-01-01")
        nxt = Version(first)
        bumped = f"{nxt.major}.{nxt.minor + 1}.0"
        moved = bump(root, "kvtier-blockpool", bumped)
        assert moved, "bump moved no sibling pin"
        about = packages(root)["kvtier-blockpool"].about.read_text(encoding="utf-8")
        assert about.endswith(f'"{bumped}"\n'), f"bump wrote {about!r}"
        assert problems(root, history=False) == [], problems(root, history=False)
        release(root, "kvtier-blockpool", "2999-01-02")
        assert problems(root, history=False) == [], problems(root, history=False)
        edit(root / pool / "CHANGELOG.md", "— 2999-01-02", "— 2000-01-02")
        assert problems(root, history=False), "not caught: dates out of order"
    print(f"versions self-test: {len(cases) + 2} planted offences caught, bump and release ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--self-test", action="store_true")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("check")
    b = sub.add_parser("bump")
    b.add_argument("dist")
    b.add_argument("version")
    r = sub.add_parser("release")
    r.add_argument("dist")
    r.add_argument("--date", default=datetime.date.today().isoformat())
    args = parser.parse_args(argv)
    if args.self_test:
        self_test()
        return 0
    if args.command == "bump":
        for line in bump(ROOT, args.dist, args.version):
            print(line)
        return 0
    if args.command == "release":
        release(ROOT, args.dist, args.date)
        return 0
    if _git(ROOT, "rev-parse", "HEAD") is None:
        print("versions: no git history here: releases are not compared with later changes")
    found = problems(ROOT)
    for line in found:
        print(line)
    if not found:
        print(f"versions: {len(packages(ROOT))} packages, each version matches its changelog")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
