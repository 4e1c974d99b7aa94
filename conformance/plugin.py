"""pytest plugin: vLLM's own offloading tests, run against kvtier's classes.

The nox session ``conformance`` extracts the test files named in ``suite.toml`` from
vLLM's source distribution, unedited, and runs them with this plugin
(``-p conformance.plugin``), one suite per vLLM release (``conformance/vllm_0_32/``,
``conformance/vllm_0_33/``: which files, and the expected deviations; the session names
it in ``KVTIER_CONFORMANCE_SUITE``). Before any test module is imported
(``pytest_configure``) it points vLLM at kvtier:

* by configuration: ``KVTIER_UPSTREAM_NAMES=1`` and kvtier-tiering-spec's vLLM plugin,
  so ``OffloadingSpecFactory`` answers ``CPUOffloadingSpec`` and
  ``TieringOffloadingSpec`` and ``KVConnectorFactory`` answers ``OffloadingConnector``
  with kvtier's classes;
* by rebinding the names the tests import: ``CPUOffloadingManager`` (a thin class
  that builds :class:`~kvtier.tiering_spec.vllm_manager.KvtierOffloadingManager` from
  the manager's arguments, and shows kvtier's pool and policy state under the names of
  vLLM's manager and policies that the tests read), ``CPUOffloadingSpec``,
  ``TieringOffloadingSpec`` and
  ``OffloadingConnector`` (kvtier's);
* the model names the tests give (``facebook/opt-125m`` for every scheduler test's
  config, ``meta-llama/Llama-3.2-1B-Instruct`` for the engine tests) are redirected
  with vLLM's ``VLLM_MODEL_REDIRECT_PATH`` to a tiny local Llama made by
  kvtier-testkit, and the hub is off (``HF_HUB_OFFLINE=1``).

The files that run, and why (each builds kvtier's manager, spec, policy or connector):

* ``tests/v1/kv_offload/cpu/test_manager.py``: the manager (``CPUOffloadingManager``);
* ``tests/v1/kv_offload/cpu/policies/test_factory.py``: ``CachePolicyFactory`` and
  custom policies behind the manager;
* ``tests/v1/kv_offload/test_factory.py``: the spec factory, the specs' sizing and
  their metric definitions;
* ``tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py``,
  ``test_config.py``, ``test_events.py`` and ``test_metrics.py``: the connector
  (kvtier's ``OffloadingConnector``) in vLLM's scheduler, its configuration, its KV
  events and its metrics;
* ``tests/v1/kv_connector/unit/test_offloading_connector.py``: engine tests through
  ``LLM`` (those vLLM runs on CPU);
* of ``tests/v1/kv_offload/tiering/test_tiering_offloading.py``, the one test that
  builds a spec (``TieringOffloadingSpec``'s metric definitions).

Left out, because they test vLLM's internals and never build a kvtier class: the rest
of the tiering suite (``kv_offload/tiering/``: vLLM's tiers, p2p, backpressure), the shared
offload region, the file mapper, the canonical layout and the swap kernels
(``test_canonical_layout.py``, ``test_swap_blocks_*.py``, ``test_gpu_worker.py``,
``test_canonical_mapping.py``), and the connector's worker tests
(``test_worker.py``, ``test_worker_metadata.py``: vLLM's connector worker behind mock
and bare specs, and its metadata).

Expected deviations are in ``deviations.toml``: each is marked ``xfail(strict=True)``
with the exception it must fail with and a pattern of its cause (``match``, searched in
"Type: message" and the statement that raised it), so any other failure fails the run,
and so do a deviation that starts passing and an entry that matches no test.

Each test's setup and call are watched for a Python call into kvtier's code (see
``_NOT_KVTIER`` for the modules that do not count): the summary says how many of the
passes and of the deviations ran it, and ``results.json`` in ``KVTIER_CONFORMANCE_DIR``
holds each test's outcome. Every ``OffloadingConnectorScheduler`` the tests build runs
kvtier's replacements of vLLM's store planning, hit-source split and sliding-window scan
(see ``_plan_stores_with_kvtier``), as the one kvtier's connector builds does. A
deviation may name a ``mirror``: the test that checks its scenario against kvtier
(kvtier's own, which must exist, or one of the suite, which must pass).
``KVTIER_CONFORMANCE_BASELINE=1`` runs the same tests with the same models against
vLLM's own classes, without deviations (whose failure is it?).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
# The release's suite folder (suite.toml, deviations.toml), named by the nox session.
SUITE = Path(os.environ.get("KVTIER_CONFORMANCE_SUITE") or HERE / "vllm_0_32")
DEVIATIONS = SUITE / "deviations.toml"
REASON_PREFIXES = (
    "kvtier differs on purpose: ",
    "reads vLLM's private internals: ",
    "fails with vLLM's own classes here too: ",
    "needs the hub model's weights: ",
    "not yet in kvtier: ",
)
# The hub models the tests name; each is redirected to the tiny local model.
HUB_MODELS = ("facebook/opt-125m", "meta-llama/Llama-3.2-1B-Instruct")


def _exception(name: str) -> type[BaseException]:
    """The exception class a deviation names: a builtin, or kvtier's ``ConfigError``."""
    import builtins

    from kvtier.tiering_spec.config import ConfigError

    cls = ConfigError if name == "ConfigError" else getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise pytest.UsageError(f"{DEVIATIONS.name}: raises={name!r} is no exception class")
    return cls


def _load_deviations() -> list[tuple[str, str, dict[str, Any], str | None]]:
    """(node id or pattern, reason, xfail's other arguments, the cause's pattern) of
    each listed deviation. A test is a node id, or a table ``{test = ..., match = ...}``
    whose ``match`` replaces its group's."""
    data = tomllib.loads(DEVIATIONS.read_text())
    entries = []
    for group in data.get("deviation", []):
        reason = group["reason"]
        if not reason.startswith(REASON_PREFIXES):
            raise pytest.UsageError(
                f"{DEVIATIONS.name}: a reason must start with one of {REASON_PREFIXES}, "
                f"got {reason!r}"
            )
        # run = false: listed, not run; raises: the failure must be this exception.
        options: dict[str, Any] = {"run": bool(group.get("run", True))}
        if "raises" in group:
            options["raises"] = _exception(group["raises"])
        for mirror in group.get("mirror", []):
            _check_mirror(mirror)
        for test in group["tests"]:
            match = group.get("match")
            if isinstance(test, dict):
                test, match = test["test"], test.get("match", match)
            if options["run"] and not (options.get("raises") and match):
                raise pytest.UsageError(
                    f"{DEVIATIONS.name}: {test}: a deviation that runs names its cause: "
                    "raises (the exception) and match (a regular expression searched in "
                    "'Type: message' and the statement that raised it)"
                )
            if match is not None:
                re.compile(match)
            entries.append((test, reason, options, match))
    return entries


def _check_mirror(mirror: str) -> None:
    """A deviation's ``mirror``: a test that checks its scenario's outcomes against
    kvtier, either kvtier's (``packages/...::name``, which must exist, and which kvtier's
    own sessions run) or one of this suite's (``tests/...``, which must pass here)."""
    path, _, name = mirror.partition("::")
    if path.startswith("tests/"):
        _MIRRORS.add(mirror)
        return
    source = HERE.parent / path
    if not (name and source.is_file() and f"def {name}(" in source.read_text()):
        raise pytest.UsageError(f"{DEVIATIONS.name}: mirror {mirror!r} names no test")


_MIRRORS: set[str] = set()  # this suite's tests that deviations name as their mirrors


def _redirect_models(workdir: Path) -> None:
    """Point the hub model names at a tiny local Llama (vLLM's own redirect file)."""
    from kvtier.testkit.model import make_tiny_llama

    root = Path(os.environ.get("KVTIER_TINY_MODEL_DIR") or workdir / "models")
    # 4 KV heads (a tensor-parallel shard must cover them exactly in test_config.py);
    # facebook/opt-125m's 2,048 positions (the scheduler tests' long prompts need them).
    model = make_tiny_llama(root, heads=4, head_dim=64, hidden=256, positions=2048)
    redirect = workdir / "model-redirect.json"
    redirect.write_text(json.dumps({name: str(model) for name in HUB_MODELS}))
    os.environ["VLLM_MODEL_REDIRECT_PATH"] = str(redirect)


def _substitute() -> list[tuple[Any, str, Any]]:
    """Register kvtier's names with vLLM's factories, and rebind vLLM's class names that
    the tests import to kvtier's classes; returns what was rebound, to restore."""
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as vllm_connector
    import vllm.v1.kv_offload.cpu.manager as vllm_manager
    import vllm.v1.kv_offload.cpu.spec as vllm_cpu_spec
    import vllm.v1.kv_offload.tiering.spec as vllm_tiering_spec
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from conformance import adapters
    from kvtier.tiering_spec import connector, plugin, vllm_adapter

    plugin.register()
    specs = {
        name: OffloadingSpecFactory.get_spec_cls({"spec_name": name})
        for name in ("CPUOffloadingSpec", "TieringOffloadingSpec")
    }
    connector_cls = KVConnectorFactory.get_connector_class_by_name("OffloadingConnector")
    if (
        not plugin.overridden()
        or connector_cls is not connector.OffloadingConnector
        or any(cls is not getattr(vllm_adapter, name) for name, cls in specs.items())
    ):
        raise pytest.UsageError(
            f"vLLM's names do not resolve to kvtier's classes: {specs}, {connector_cls}"
        )
    rebound = [
        (vllm_manager, "CPUOffloadingManager", adapters.CPUOffloadingManager),
        (vllm_cpu_spec, "CPUOffloadingSpec", vllm_adapter.CPUOffloadingSpec),
        (vllm_tiering_spec, "TieringOffloadingSpec", vllm_adapter.TieringOffloadingSpec),
        (vllm_connector, "OffloadingConnector", connector.OffloadingConnector),
    ]
    _plan_stores_with_kvtier()
    saved = [(module, name, getattr(module, name)) for module, name, _ in rebound]
    for module, name, cls in rebound:
        setattr(module, name, cls)
    return saved


def _plan_stores_with_kvtier() -> None:
    """Run kvtier's scheduler-side replacements of vLLM's code (kvtier-vllm-port's
    ``store_planning``, and ``lookups``' split of a hit by tier and sliding-window scan)
    in every vLLM
    ``OffloadingConnectorScheduler`` the tests build, as kvtier's connector runs them in
    the one it builds with kvtier's manager: vLLM's scheduler tests drive it with vLLM's
    mock spec and manager, or build it alone, and their scenarios then check that
    kvtier's code plans and answers what vLLM's does. (``lookups``' one-call prefix
    lookup needs kvtier's manager, which vLLM's mock is not.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as module

    from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager
    from kvtier.vllm_port import lookups, store_planning

    cls = module.OffloadingConnectorScheduler
    init = cls.__init__

    def with_kvtier_planning(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not isinstance(getattr(self, "manager", None), KvtierOffloadingManager):
            store_planning.speed_up(self)  # (kvtier's connector does it for its manager)
            lookups.single_source_hits(self)

    cls.__init__ = with_kvtier_planning
    # The sliding-window scan is a method of every scheduler (vLLM's tests call it on
    # schedulers they build without __init__), as kvtier's connector installs it on its.
    scan = lookups.window_scan(cls)
    if scan is None:
        raise pytest.UsageError(f"kvtier's sliding-window scan does not fit {cls}")
    cls._sliding_window_lookup = scan


def _platform_as_vllms_ci() -> None:
    """A vLLM without a build for this machine (0.33: no CPU build) runs on its
    placeholder platform, which says it cannot run the hybrid KV cache manager; vLLM's
    scheduler tests enable it, as their CI's GPU platform can. They build configs and run
    scheduler-side Python only, so the placeholder says yes here too."""
    from vllm.platforms import current_platform

    if current_platform.is_unspecified() and not current_platform.support_hybrid_kv_cache():
        type(current_platform).support_hybrid_kv_cache = classmethod(lambda cls: True)


def pytest_configure(config: pytest.Config) -> None:
    baseline = os.environ.get("KVTIER_CONFORMANCE_BASELINE") == "1"
    _platform_as_vllms_ci()
    os.environ["KVTIER_UPSTREAM_NAMES"] = "0" if baseline else "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    workdir = Path(os.environ.get("KVTIER_CONFORMANCE_DIR") or tempfile.mkdtemp())
    workdir.mkdir(parents=True, exist_ok=True)
    _redirect_models(workdir)
    for marker in ("slow_test", "skip_global_cleanup", "cpu_test", "optional", "distributed"):
        config.addinivalue_line("markers", f"{marker}: vLLM's marker")
    if baseline:
        # vLLM's own classes, the same tests and models: what vLLM itself passes here.
        config.stash[_DEVIATIONS] = []
        return
    config.stash[_SAVED] = _substitute()
    config.stash[_DEVIATIONS] = _load_deviations()


_DEVIATIONS = pytest.StashKey[list[tuple[str, str, dict[str, Any], str | None]]]()
_MATCH = pytest.StashKey[str]()
_SAVED = pytest.StashKey[list[tuple[Any, str, Any]]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once the test modules hold kvtier's classes, give vLLM its own names back: vLLM's
    code that imports them when it runs (its metrics ask ``issubclass(spec,
    CPUOffloadingSpec)``) then sees what it sees in an engine with kvtier installed."""
    for module, name, original in session.config.stash.get(_SAVED, []):
        setattr(module, name, original)


def _node_id(item: pytest.Item) -> str:
    """The node id from ``tests/`` on, whatever folder the suite was extracted to."""
    nodeid = item.nodeid
    at = nodeid.find("tests/v1/")
    return nodeid[at:] if at >= 0 else nodeid


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each listed deviation ``xfail(strict=True)``; an entry that matches no test
    of a file that was collected is stale, and stops the run."""
    deviations = config.stash[_DEVIATIONS]
    used: set[str] = set()
    files: set[str] = set()
    for item in items:
        nodeid = _node_id(item)
        files.add(nodeid.split("::", 1)[0])
        for pattern, reason, options, match in deviations:
            if nodeid == pattern or fnmatch.fnmatchcase(nodeid, pattern):
                used.add(pattern)
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True, **options))
                if match is not None:
                    item.stash[_MATCH] = match
                break
    stale = [p for p, _, _, _ in deviations if p not in used and p.split("::", 1)[0] in files]
    if config.getoption("keyword") or config.getoption("markexpr"):
        stale = []  # a selection: entries may well match nothing in it
    _STALE.update(stale)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: tell the controller
        workeroutput["kvtier_stale"] = stale


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist's controller: the stale entries a worker found."""
    _STALE.update(getattr(node, "workeroutput", {}).get("kvtier_stale", ()))


def _unmirrored() -> list[str]:
    """Mirrors of this suite that ran and did not pass (none run: a selection)."""
    return sorted(m for m in _MIRRORS if _RESULTS.get(m, {}).get("outcome", "passed") != "passed")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if (_STALE or _unmirrored()) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- which tests exercise kvtier --------------------------------------------------------

# Whose code counts as kvtier's behaviour: every kvtier module but the test helpers and
# those that only forward to vLLM's code here. kvtier's ``OffloadingConnector`` is vLLM's
# unchanged unless a kvtier spec drives it (whose code then counts); the plugin registers
# names; the port (port, interface, gen_*, facts and facts_reader) and vllm_compat read
# vLLM's facts and shapes.
_NOT_KVTIER = (
    "kvtier.testkit",
    "kvtier.vllm_port.port",
    "kvtier.vllm_port.interface",
    "kvtier.vllm_port.gen_",
    "kvtier.vllm_port.facts",
    "kvtier.vllm_port.plugins",
    "kvtier.vllm_port.schema",
    "kvtier.tiering_spec.connector",
    "kvtier.tiering_spec.plugin",
    "kvtier.tiering_spec.vllm_compat",
)
_EXERCISED = pytest.StashKey[bool]()


def _is_kvtier(module: object) -> bool:
    return (
        isinstance(module, str)
        and module.startswith("kvtier.")
        and not module.startswith(_NOT_KVTIER)
    )


class _Watch:
    """A profile function (``sys.setprofile``) that notes the first Python call into
    kvtier's code and then takes itself off, so a test pays for it only until kvtier
    runs."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def start(self) -> None:
        self._previous = sys.getprofile()
        sys.setprofile(self)

    def stop(self) -> None:
        if sys.getprofile() is self:
            sys.setprofile(self._previous)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and _is_kvtier(frame.f_globals.get("__name__")):
            self.seen = True
            sys.setprofile(self._previous)


def _watched(item: pytest.Item) -> Any:
    """Run a test phase (setup, call) noting whether kvtier's code ran in it."""
    if item.stash.get(_EXERCISED, False):
        yield
        return
    watch = _Watch()
    watch.start()
    try:
        yield
    finally:
        watch.stop()
        item.stash[_EXERCISED] = watch.seen


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    yield from _watched(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    yield from _watched(item)


def _failure_text(excinfo: Any) -> str:
    """What a deviation's ``match`` is searched in: the exception as pytest shows it
    (type: message) and the statement it was raised at."""
    text = excinfo.exconly()
    try:
        text += "\n" + str(excinfo.traceback[-1].statement).strip()
    except Exception:  # no source at hand (a compiled frame)
        pass
    return text


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "teardown":
        return
    report.user_properties.append(("kvtier_exercised", item.stash.get(_EXERCISED, False)))
    if call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
        return
    text = _failure_text(call.excinfo)
    report.user_properties.append(("kvtier_failure", text))
    if not (report.skipped and hasattr(report, "wasxfail")):
        return
    # An expected deviation: it must fail for the cause its entry names.
    match = item.stash.get(_MATCH, None)
    if match is not None and not re.search(match, text):
        report.outcome = "failed"
        del report.wasxfail
        report.longrepr = (
            f"{item.nodeid}: an expected deviation failed for another cause than its "
            f"entry in {DEVIATIONS.name} names (match = {match!r}):\n{text}\n\n"
            f"{call.excinfo.getrepr(style='short')}"
        )


_STALE: set[str] = set()
_COUNTS: dict[str, int] = {"passed": 0, "failed": 0, "xpassed": 0, "skipped": 0}
_BY_REASON: dict[str, int] = {}
# Of the passed tests and of the expected deviations, those that ran kvtier's code, by
# test file; and each test's outcome (written to KVTIER_CONFORMANCE_DIR/results.json).
_EXERCISING: dict[str, dict[str, int]] = {"passed": {}, "deviations": {}}
_RESULTS: dict[str, dict[str, Any]] = {}


def _record(report: pytest.TestReport, outcome: str) -> None:
    props = dict(report.user_properties)
    exercised = bool(props.get("kvtier_exercised"))
    nodeid = report.nodeid[max(report.nodeid.find("tests/v1/"), 0) :]
    entry: dict[str, Any] = {"outcome": outcome, "kvtier": exercised}
    if "kvtier_failure" in props:
        entry["failure"] = props["kvtier_failure"]
    _RESULTS[nodeid] = entry
    if exercised and outcome in _EXERCISING:
        per_file = _EXERCISING[outcome]
        name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        per_file[name] = per_file.get(name, 0) + 1


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count each test once (on the controller under pytest-xdist too)."""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        reason = getattr(report, "wasxfail", None)
        if reason is not None and report.skipped:
            text = str(reason)
            kind = next((p for p in REASON_PREFIXES if text.startswith(p)), None)
            if kind is None:  # "[NOTRUN] ...": listed with run = false
                text = text.removeprefix("[NOTRUN] ")
                kind = next((p for p in REASON_PREFIXES if text.startswith(p)), "other")
                kind = f"{kind.rstrip(': ')} (listed, not run)"
            _BY_REASON[kind] = _BY_REASON.get(kind, 0) + 1
            _record(report, "deviations")
        elif reason is not None or str(report.longrepr).startswith("[XPASS(strict)]"):
            _COUNTS["xpassed"] += 1
            _record(report, "xpassed")
        elif report.passed:
            _COUNTS["passed"] += 1
            _record(report, "passed")
        elif report.skipped:
            _COUNTS["skipped"] += 1
            _record(report, "skipped")
        else:
            _COUNTS["failed"] += 1
            _record(report, "failed")
    elif report.when == "teardown" and report.failed:
        _COUNTS["failed"] += 1


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    deviations = sum(_BY_REASON.values())
    ran = deviations + _COUNTS["passed"] + _COUNTS["failed"] + _COUNTS["xpassed"]
    exercising = {k: sum(v.values()) for k, v in _EXERCISING.items()}
    write = terminalreporter.write_line
    import vllm

    terminalreporter.write_sep("=", f"kvtier against vLLM {vllm.__version__}'s offloading tests")
    write(
        f"ran {ran}: {_COUNTS['passed']} passed, of which {exercising['passed']} ran "
        f"kvtier's code; {deviations} expected deviations, of which "
        f"{exercising['deviations']} ran kvtier's code; {_COUNTS['failed']} failed, "
        f"{_COUNTS['xpassed']} deviations that now pass; {_COUNTS['skipped']} skipped by "
        "vLLM on this platform"
    )
    write(f"passed and ran kvtier's code: {exercising['passed']}")
    for name, count in sorted(_EXERCISING["passed"].items()):
        write(f"  {count:4d}  {name}")
    write("expected deviations, by reason:")
    for kind, count in sorted(_BY_REASON.items()):
        write(f"  {count:4d}  {kind.rstrip(': ')}")
    for mirror in _unmirrored():
        write(f"a deviation's mirror did not pass (see {DEVIATIONS.name}): {mirror}")
    for pattern in sorted(_STALE):
        write(f"stale entry of {DEVIATIONS.name} (it matches no test; remove it): {pattern}")
    workdir = os.environ.get("KVTIER_CONFORMANCE_DIR")
    if workdir and _RESULTS:
        out = Path(workdir) / "results.json"
        out.write_text(json.dumps(dict(sorted(_RESULTS.items())), indent=1))
        write(f"each test's outcome, and whether it ran kvtier's code: {out}")
