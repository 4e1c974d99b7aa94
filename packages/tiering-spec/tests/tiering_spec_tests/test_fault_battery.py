"""Fault battery of the fs tier: every way a file on disk could put wrong KV into the
device cache, each shown to give a miss, never a load.

Item 1, never load KV from another model or layout: the fingerprint of the fs tier
covers the contents of the weight files, the model's config and dtype, the
block-hash scheme and the KV layout; a change of any of them moves the engine to
another directory, so old files are neither indexed nor read.

Item 3, trust nothing on disk: directories that are links, another user's, or
writable by group or others are refused at start; block files are opened without
following links, so a link planted under a block's name is never read.

Item 2, never fill a disk: a default capacity from the free space, the restart scan
(damaged, stale and old-fingerprint files) in the background; ENOSPC handling is in
test_fs_tier.

Item 4, storage never blocks the scheduler: no filesystem call on a lookup; a folder
deleted at run time is made again; a cache reset and a shutdown wait for hung fs jobs
a bounded time, count the timeout as a fault, and never hand out a host block that a
late read may still fill; a transfer the copy engine refuses is recomputed, not fatal.

Item 6, replicated KV kept once: test_replicated (engine-free) and test_e2e_tp2's TP 2 run
of an MLA model. Item 7, the fs tier's CPU cost: ``nox -s bench-tiering`` prints its bar.

Item 5, configuration: unknown keys are named in a warning; strings are refused where
a boolean or a number is expected; thread counts are bounded; a capacity that cannot
hold one file is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiering_spec.config import ConfigError, FsTierConfig, parse_config
from kvtier.tiering_spec.identity import digest_model, model_files
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs import scan as fs_scan
from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

from .tier_support import wait_results

try:  # whether this vLLM builds specs from vLLM 0.32's OffloadingConfig
    from kvtier.tiering_spec.vllm_compat import CONFIG_API
except ImportError:  # no vLLM: the tests that need one skip
    CONFIG_API = True

# ------------------------------------------------------------------ weight digests


def make_model_dir(path: Path, weights: bytes = b"\x01" * 300_000) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"hidden_size": 128}')
    (path / "tokenizer.json").write_text('{"vocab": 1}')
    return path


def test_new_weights_of_the_same_size_and_mtime_change_the_digest(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "m")
    cache = str(tmp_path / "digests.json")
    before = digest_model(str(model), cache_path=cache)
    weights = model / "model.safetensors"
    st = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[150_000] ^= 0xFF  # one byte in the middle of the file, as a partial fine-tune
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    after = digest_model(str(model), cache_path=cache)
    assert after.digest != before.digest, "rewritten weights kept the old digest"
    assert after.hashed_bytes == len(data), "the rewritten file was served from the cache"


def test_unchanged_files_are_not_read_again(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "m")
    cache = str(tmp_path / "digests.json")
    first = digest_model(str(model), cache_path=cache)
    again = digest_model(str(model), cache_path=cache)
    assert first.hashed_bytes > 0
    assert again.hashed_bytes == 0 and again.digest == first.digest


def test_a_changed_config_changes_the_digest_and_tokenizer_files_do_not(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "m")
    base = digest_model(str(model)).digest
    (model / "tokenizer.json").write_text('{"vocab": 2}')
    assert digest_model(str(model)).digest == base
    (model / "config.json").write_text('{"hidden_size": 128, "rope_theta": 20000}')
    assert digest_model(str(model)).digest != base


def test_the_same_weights_in_another_folder_have_the_same_digest(tmp_path: Path) -> None:
    a = make_model_dir(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert digest_model(str(a)).digest == digest_model(str(b)).digest


def test_pickled_weights_beside_safetensors_are_not_read(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"\x02" * 1000)
    assert "pytorch_model.bin" not in model_files(str(model))
    assert "pytorch_model.bin" in model_files(str(model), prefer_safetensors=False)


def test_a_folder_without_weight_files_is_not_identified(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight file"):
        digest_model(str(tmp_path / "m"))


# ------------------------------------------------------------------ item 5: configuration


def tier_config(tmp_path: Path, **tier: object) -> dict[str, object]:
    return {
        "cpu_bytes_to_use": 1 << 24,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs"), **tier}],
    }


def test_unknown_top_level_keys_are_named_in_a_warning(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        parse_config({**tier_config(tmp_path), "cpu_bytes_to_usee": 5}, tiering=True)
    assert "cpu_bytes_to_usee" in caplog.text and "known keys" in caplog.text


def test_known_top_level_keys_are_not_warned_about(tmp_path: Path, caplog) -> None:
    extra = {**tier_config(tmp_path), "spec_name": "TieringOffloadingSpec", "model_identity": "m"}
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        parse_config(extra, tiering=True)
    assert "unknown" not in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        {"offload_prompt_only": "false"},
        {"canonical_layout": "false"},
        {"self_describing_kv_events": "true"},
    ],
)
def test_string_booleans_are_refused(tmp_path: Path, extra: dict[str, object]) -> None:
    [key] = extra
    with pytest.raises(ConfigError, match=f"{key} must be a JSON boolean"):
        parse_config({**tier_config(tmp_path), **extra}, tiering=True)


def test_a_string_boolean_in_a_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].enable_kv_events must be"):
        parse_config(tier_config(tmp_path, enable_kv_events="false"), tiering=True)


@pytest.mark.parametrize(
    "key",
    ["cpu_bytes_to_use", "blocks_per_chunk", "store_threshold", "max_tracker_size"],
)
def test_numeric_strings_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_config({**tier_config(tmp_path), key: "8"}, tiering=True)


@pytest.mark.parametrize("key", ["n_read_threads", "n_write_threads"])
def test_thread_counts_are_bounded(tmp_path: Path, key: str) -> None:
    parse_config(tier_config(tmp_path, **{key: 256}), tiering=True)
    with pytest.raises(ConfigError, match=rf"{key} must be an integer >= 1 and <= 256"):
        parse_config(tier_config(tmp_path, **{key: 257}), tiering=True)
    with pytest.raises(ConfigError, match=key):
        parse_config(tier_config(tmp_path, **{key: "4"}), tiering=True)


def test_a_capacity_smaller_than_one_file_is_refused(tmp_path: Path) -> None:
    payload = 8192
    entry = fs_format.HEADER_SIZE + payload
    cfg = FsTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=entry - 1)
    with pytest.raises(ConfigError, match=rf"capacity_bytes={entry - 1} .* at least {entry}"):
        FileSystemTier(cfg, [{"model": "unit", "rank": 0}], payload, lambda: None)
    ok = FileSystemTier(
        FsTierConfig(root_dir=str(tmp_path / "fs"), capacity_bytes=entry),
        [{"model": "unit", "rank": 0}],
        payload,
        lambda: None,
    )
    ok.shutdown()


# ------------------------------------------------------------------ item 3: trust nothing on disk


def make_fs_tier(root: Path, payload: int = 8192, views: Any = lambda: None) -> FileSystemTier:
    cfg = FsTierConfig(root_dir=str(root), n_read_threads=1, n_write_threads=1)
    tier = FileSystemTier(cfg, [{"model": "unit", "rank": 0}], payload, views)
    assert tier.wait_scan(30)
    return tier


def test_a_root_dir_writable_by_others_is_refused_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(ConfigError, match=r"writable by group or others .* chmod go-w"):
        parse_config(tier_config(tmp_path), tiering=True)
    with pytest.raises(ConfigError, match="chmod go-w"):
        make_fs_tier(root)


def test_a_root_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "fs").symlink_to(real)
    with pytest.raises(ConfigError, match="is a symlink"):
        make_fs_tier(tmp_path / "fs")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_a_root_dir_of_another_user_is_refused_with_the_fix(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(ConfigError, match=r"belongs to uid 12345.*chown"):
        parse_config(tier_config(tmp_path), tiering=True)


def test_a_shard_directory_swapped_for_a_link_is_refused_at_start(tmp_path: Path) -> None:
    first = make_fs_tier(tmp_path / "fs")
    shard = Path(first.dirs[0]) / "a"
    first.shutdown()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    shard.rmdir()
    shard.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="is a symlink"):
        make_fs_tier(tmp_path / "fs")


def test_a_link_under_a_block_name_is_neither_indexed_nor_read(tmp_path: Path) -> None:
    import mmap

    from kvtier.tiering_spec.tiers.fs.format import key_digest

    payload = 8192
    region = mmap.mmap(-1, 2 * payload)
    views = lambda: [memoryview(region)]  # noqa: E731
    tier = make_fs_tier(tmp_path / "fs", payload, views)
    region[:payload] = b"\x07" * payload
    assert tier.submit_write(b"k", key_digest(b"k"), 0)
    wait_results(tier)
    [good] = tier.paths(key_digest(b"k"))
    [planted] = tier.paths(key_digest(b"other"))
    os.symlink(good, planted)  # a valid file of this tier, reached through a link
    tier.shutdown()
    again = make_fs_tier(tmp_path / "fs", payload, views)
    assert again.stats.files_indexed_at_start == 1, "the link was indexed"
    assert not again.contains(key_digest(b"other"))
    # Even a read of that path with the target's own key refuses to follow the link.
    with pytest.raises(OSError):
        shard, name = again._where(key_digest(b"other"))
        again._read_file(
            0, shard, name, again.fingerprints[0], key_digest(b"k"), memoryview(region)[payload:]
        )
    assert bytes(region[payload:]) == bytes(payload)
    again.shutdown()


# ------------------------------------------------------------------ item 2: never fill a disk


def _written_tier(root: Path, keys: list[bytes], payload: int = 8192) -> FileSystemTier:
    import mmap

    from kvtier.tiering_spec.tiers.fs.format import key_digest

    region = mmap.mmap(-1, max(1, len(keys)) * payload)
    tier = make_fs_tier(root, payload, lambda: [memoryview(region)])
    for i, k in enumerate(keys):
        region[i * payload : (i + 1) * payload] = bytes([i + 1]) * payload
        assert tier.submit_write(k, key_digest(k), i)
    wait_results(tier, len(keys))
    return tier


def test_without_capacity_bytes_the_tier_takes_half_the_free_space(tmp_path: Path) -> None:
    tier = _written_tier(tmp_path / "fs", [])
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    assert tier.capacity_is_default and tier.capacity_bytes is not None
    assert abs(tier.capacity_bytes - free // 2) <= free // 100, (tier.capacity_bytes, free)
    tier.shutdown()


def test_the_restart_scan_removes_damaged_and_stale_files(tmp_path: Path) -> None:
    from kvtier.tiering_spec.tiers.fs.format import TMP_PREFIX, key_digest

    root = tmp_path / "fs"
    first = _written_tier(root, [b"a", b"b", b"c"])
    [a], [b] = first.paths(key_digest(b"a")), first.paths(key_digest(b"b"))
    first.shutdown()
    os.truncate(a, 0)  # zero-length
    os.truncate(b, 100)  # wrong size
    shard = os.path.dirname(a)
    stale, fresh = os.path.join(shard, TMP_PREFIX + "1-2-3"), os.path.join(shard, TMP_PREFIX + "4")
    for path in (stale, fresh):
        open(path, "wb").close()
    os.utime(stale, (time.time() - 2 * 3600, time.time() - 2 * 3600))
    again = make_fs_tier(root)
    assert again.stats.files_indexed_at_start == 1 and again.has(key_digest(b"c"))
    assert not os.path.exists(a) and not os.path.exists(b), "damaged block files stay"
    assert not os.path.exists(stale), "an orphaned temporary file past its grace stays"
    assert os.path.exists(fresh), "a temporary file of a live writer was removed"
    again.shutdown()


def test_the_restart_scan_removes_old_fingerprints_past_the_age_limit(tmp_path: Path) -> None:

    root = tmp_path / "fs"
    make_fs_tier(root).shutdown()
    base = root / fs_format.FORMAT_DIR
    old, recent = base / ("0" * 32), base / ("1" * 32)
    for d in (old, recent):
        (d / "3").mkdir(parents=True)
        (d / "3" / "x.kv").write_bytes(b"x")
    past = time.time() - fs_scan.STALE_FINGERPRINT_AGE_S - 60
    for path in (old, old / "3"):
        os.utime(path, (past, past))
    (base / "weight-digests.json").write_text("{}")
    tier = make_fs_tier(root)
    assert not old.exists(), "an unused fingerprint past the age limit stays"
    assert recent.exists() and (base / "weight-digests.json").exists()
    tier.shutdown()


def test_the_engine_starts_before_the_scan_ends_and_serves_what_it_finds(
    tmp_path: Path,
) -> None:
    from kvtier.tiering_spec.tiers.fs.format import key_digest

    root = tmp_path / "fs"
    _written_tier(root, [b"a"]).shutdown()
    cfg = FsTierConfig(root_dir=str(root), n_read_threads=1, n_write_threads=1)
    tier = FileSystemTier(cfg, [{"model": "unit", "rank": 0}], 8192, lambda: None)
    assert tier.wait_scan(30) and tier.stats.files_indexed_at_start == 1
    assert tier.contains(key_digest(b"a")) and tier.used_bytes == tier.entry_bytes
    tier.shutdown()


# ------------------------------------------------------------------ item 4: storage never blocks


def test_a_lookup_never_touches_the_filesystem(tmp_path: Path, monkeypatch) -> None:
    import threading

    from kvtier.tiering_spec.tiers.fs.format import key_digest

    tier = _written_tier(tmp_path / "fs", [b"a"])
    main = threading.get_ident()
    calls: list[str] = []
    for name in ("stat", "lstat", "open", "scandir", "listdir"):
        real = getattr(os, name)

        def spy(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            if threading.get_ident() == main:
                calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(os, name, spy)
    assert tier.contains(key_digest(b"a"))
    assert not tier.contains(key_digest(b"missing"))
    assert calls == [], f"the scheduler thread called {calls}"
    monkeypatch.undo()
    tier.shutdown()


def test_a_shard_folder_deleted_at_run_time_is_made_again(tmp_path: Path) -> None:
    import mmap

    from kvtier.tiering_spec.tiers.fs.format import key_digest

    payload = 8192
    region = mmap.mmap(-1, 2 * payload)
    tier = make_fs_tier(tmp_path / "fs", payload, lambda: [memoryview(region)])
    [path] = tier.paths(key_digest(b"k"))
    shutil.rmtree(os.path.dirname(os.path.dirname(path)))  # the whole fingerprint folder
    region[:payload] = b"\x05" * payload
    assert tier.submit_write(b"k", key_digest(b"k"), 0)
    [res] = wait_results(tier)
    assert res.ok and os.path.isfile(path) and tier.stats.folders_recreated >= 1
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    region[:payload] = bytes(payload)
    assert tier.submit_read(b"k", key_digest(b"k"), 0)
    [res] = wait_results(tier)
    assert res.ok and region[:payload] == b"\x05" * payload
    tier.shutdown()


def _hung_reads(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make every fs read hang (as on a dead network mount) until the event is set."""
    import threading

    from kvtier.tiering_spec.tiers.fs import io as fs_io

    release = threading.Event()
    real = fs_io._preadv

    def hung(*a: Any) -> int:
        release.wait(30)
        return real(*a)

    monkeypatch.setattr(fs_io, "_preadv", hung)
    return release


def test_a_reset_does_not_wait_forever_for_a_hung_read(tmp_path: Path, monkeypatch) -> None:
    import mmap

    from kvtier.blockpool import HostBlockPool
    from kvtier.tiering_spec import manager as manager_mod
    from kvtier.tiering_spec.manager import Lookup, TierManager

    payload = 8192
    region = mmap.mmap(-1, 4 * payload)
    tier = make_fs_tier(tmp_path / "fs", payload, lambda: [memoryview(region)])
    mgr = TierManager(HostBlockPool(4), [tier])
    assert mgr.prepare_store([b"k"]) is not None
    mgr.complete_store([b"k"])
    mgr.drain()
    mgr.reset(HostBlockPool(4))  # a clean reset: k is on disk only now
    release = _hung_reads(monkeypatch)
    monkeypatch.setattr(manager_mod, "DRAIN_TIMEOUT_S", 0.3)
    assert mgr.lookup(b"k") is Lookup.HIT_PENDING
    reading = mgr.pool.block_of(b"k")
    t0 = time.monotonic()
    mgr.reset(HostBlockPool(4))
    assert time.monotonic() - t0 < 5, "the reset waited for the hung read"
    assert tier.faults()["timeout"] == 1
    # The block the hung read fills is never handed out again before the read ends.
    plan = mgr.prepare_store([b"x1", b"x2", b"x3", b"x4"])
    assert plan is None or reading not in plan[1], "a block being read was reused"
    release.set()
    mgr.drain()
    assert mgr.lookup(b"k") is Lookup.HIT
    assert tier.shutdown()


def test_shutdown_returns_despite_a_hung_read_and_counts_it(tmp_path: Path, monkeypatch) -> None:
    import mmap

    from kvtier.tiering_spec.tiers.fs import tier as fs_tier
    from kvtier.tiering_spec.tiers.fs.format import key_digest

    payload = 8192
    region = mmap.mmap(-1, 2 * payload)
    tier = make_fs_tier(tmp_path / "fs", payload, lambda: [memoryview(region)])
    assert tier.submit_write(b"k", key_digest(b"k"), 0)
    wait_results(tier)
    release = _hung_reads(monkeypatch)
    monkeypatch.setattr(fs_tier, "SHUTDOWN_TIMEOUT_S", 0.3)
    assert tier.submit_read(b"k", key_digest(b"k"), 1)
    t0 = time.monotonic()
    assert tier.shutdown() is False, "a stuck I/O thread must be reported"
    assert time.monotonic() - t0 < 5, "shutdown waited for the hung read"
    assert tier.faults()["timeout"] == 1 and tier.stuck
    release.set()


# ------------------------------------------------------------------ the spec's fingerprint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tests' tiny model: the tests below rewrite its files."""
    pytest.importorskip("vllm")
    testkit = pytest.importorskip("kvtier.testkit")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    src = testkit.make_tiny_llama()  # type: ignore[attr-defined]
    dst = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(src, dst)
    return dst


def spec_fingerprint(
    model: Path,
    root: Path,
    *,
    engine: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    num_blocks: int = 64,
    kv_heads: int = 2,
    head_size: int = 64,
    layer_major: bool = True,
    rank: int = 0,
) -> tuple[bytes, dict[str, Any], bool]:
    """Build vLLM's config for ``model`` and kvtier's TieringOffloadingSpec from it, as
    the OffloadingConnector does; return rank ``rank``'s fs fingerprint and layout."""
    from kvtier.tiering_spec.vllm_adapter import TieringOffloadingSpec

    from .vllm_configs import make_spec

    kv_extra = {
        "cpu_bytes_to_use": 1 << 24,
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        **(extra or {}),
    }
    tiering = make_spec(
        TieringOffloadingSpec,
        model,
        kv_extra,
        engine=engine,
        num_blocks=num_blocks,
        kv_heads=kv_heads,
        head_size=head_size,
        layer_major=layer_major,
    )
    cache = root / fs_format.FORMAT_DIR / "weight-digests.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    identity, persistent = tiering.offload.engine_identity(str(cache))
    layout = tiering.offload.layouts(identity)[rank]
    return fs_format.layout_fingerprint(layout), layout, persistent


@pytest.fixture(scope="module")
def base(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    fp, _, persistent = spec_fingerprint(tiny_model, tmp_path_factory.mktemp("fs"))
    assert persistent, "the tiny model's weights were not identified"
    return fp


def test_the_fingerprint_is_stable_across_starts_and_device_memory(
    tiny_model: Path, tmp_path: Path, base: bytes
) -> None:
    # A restart gets another number of device blocks; the bytes of a block are the same.
    fp, layout, persistent = spec_fingerprint(tiny_model, tmp_path, num_blocks=97)
    assert persistent and fp == base, layout


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"engine": {"dtype": "bfloat16"}}, id="dtype"),
        pytest.param({"engine": {"hf_overrides": {"rope_theta": 20000.0}}}, id="hf_overrides"),
        pytest.param({"engine": {"prefix_caching_hash_algo": "sha256_cbor"}}, id="hash-algo"),
        pytest.param({"engine": {"block_size": 64}}, id="block-size"),
        pytest.param({"extra": {"blocks_per_chunk": 2}}, id="blocks-per-chunk"),
        pytest.param({"extra": {"model_identity": "tiny@v2"}}, id="model-identity"),
        pytest.param({"kv_heads": 1, "head_size": 128}, id="kv-shape"),
        pytest.param(
            {"layer_major": False},
            id="kv-placement",
            marks=pytest.mark.skipif(
                not CONFIG_API, reason="this vLLM keeps one KV tensor per layer"
            ),
        ),
    ],
)
def test_each_change_of_model_or_layout_moves_to_another_fingerprint(
    tiny_model: Path, tmp_path: Path, base: bytes, change: dict[str, Any]
) -> None:
    fp, layout, _ = spec_fingerprint(tiny_model, tmp_path, **change)
    assert fp != base, f"{change} kept the fingerprint: {layout}"


def test_random_block_hash_seeds_are_warned_about(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        _, layout, _ = spec_fingerprint(
            tiny_model, tmp_path, engine={"prefix_caching_hash_algo": "xxhash"}
        )
    assert layout["block_hash"] == ["xxhash", "random"]
    assert "PYTHONHASHSEED" in caplog.text and "never found after a restart" in caplog.text


def test_unidentified_weights_get_a_fingerprint_of_their_own(
    tiny_model: Path, tmp_path: Path, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.tiering_spec"):
        a, _, persistent = spec_fingerprint(tiny_model, tmp_path, engine={"load_format": "dummy"})
        b, _, _ = spec_fingerprint(tiny_model, tmp_path, engine={"load_format": "dummy"})
    assert not persistent and a != b
    assert "model_identity" in caplog.text


@pytest.mark.e2e
@pytest.mark.slow
def test_a_restarted_engine_of_the_same_model_indexes_its_files(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The connector hands the spec vLLM's configs (no stack walk): the fingerprint is
    verified, the same on a restart, so the second engine indexes the first one's files
    at start-up and serves from them. An unverified fingerprint is random per start and
    would index none."""
    first_run, first = _run_with_fs_tier(tiny_model, tmp_path / "fs")
    assert first.writes > 0
    second_run, second = _run_with_fs_tier(tiny_model, tmp_path / "fs")
    assert second.files_indexed_at_start > 0, "the first engine's files were not indexed"
    assert second.reads > 0
    assert second_run.outputs == first_run.outputs


def _run_with_fs_tier(model: Path, root_dir: Path) -> tuple[Any, Any]:
    """The prefix workload on ``model`` with a TieringOffloadingSpec fs tier at
    ``root_dir``: the run and the fs tier's stats."""
    from kvtier.testkit import Workload, kv_transfer_config, run_with
    from kvtier.testkit.engine import kv_connector_of

    from .e2e_support import ENGINE, offload_config, prefix_prompts

    cfg = offload_config("TieringOffloadingSpec", host_chunks=10, root_dir=str(root_dir))

    def fs_stats(llm: Any) -> Any:
        return kv_connector_of(llm).connector_scheduler.manager.core.secondary_tiers[0].stats

    return run_with(
        model,
        Workload(prefix_prompts(), 8),
        inspect=fs_stats,
        kv_transfer_config=kv_transfer_config(cfg),
        **ENGINE,
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_a_model_rewritten_in_place_gets_misses_not_its_old_kv(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The reported bug: new weights at the same path, same config, old fs files.

    The first engine fills the fs tier; the weights are then replaced by another
    seed's (same shapes, same config). The second engine must index and read none of
    the old files, and its outputs must match a reference run of the new weights."""
    from kvtier.testkit import Workload, compare_outputs, make_tiny_llama, run_with

    from .e2e_support import ROOMY, prefix_prompts

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    _, first = _run_with_fs_tier(model, tmp_path / "fs")
    assert first.writes > 0
    other = make_tiny_llama(seed=1)
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")

    reference, _ = run_with(model, Workload(prefix_prompts(), 8), **ROOMY)
    got, second = _run_with_fs_tier(model, tmp_path / "fs")
    assert second.files_indexed_at_start == 0, "the old model's files were indexed"
    cmp = compare_outputs(reference.outputs, got.outputs)
    assert cmp.identical, cmp.report()
    assert second.writes > 0
    # The new model's own files are served: a third engine indexes them at start-up.
    # (Within the second run a repeat may come before its prefix's write has landed on
    # a slow disk, and a lookup never waits for a write: that would test the disk.)
    again, third = _run_with_fs_tier(model, tmp_path / "fs")
    assert third.files_indexed_at_start > 0 and third.reads > 0, third
    cmp = compare_outputs(reference.outputs, again.outputs)
    assert cmp.identical, cmp.report()


@pytest.mark.e2e
@pytest.mark.slow
def test_transfers_the_copy_engine_refuses_are_recomputed_not_fatal(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 4: a bad plan fails that transfer, never the engine. vLLM asserts that
    every transfer succeeds; kvtier's connector reports a refused load as blocks to
    recompute and drops a refused store's host blocks."""
    from kvtier.testkit import Workload, compare_outputs, kv_transfer_config, run_with
    from kvtier.testkit.engine import kv_connector_of
    from kvtier.tiering_spec.worker import OffloadTransferWorker

    from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

    refused = {"store": 0, "load": 0}
    calls = {"store": 0, "load": 0}
    for kind in ("store", "load"):
        real = getattr(OffloadTransferWorker, f"submit_{kind}")

        def some(self: Any, *args: Any, _kind: str = kind, _real: Any = real) -> None:
            calls[_kind] += 1
            if calls[_kind] % 3 == 1:
                refused[_kind] += 1
                raise ValueError("host chunks cannot hold these device blocks (injected)")
            _real(self, *args)

        monkeypatch.setattr(OffloadTransferWorker, f"submit_{kind}", some)
    workload = Workload(prefix_prompts(), 8)
    cfg = offload_config("CPUOffloadingSpec", host_chunks=64)

    def counters(llm: Any) -> Any:
        return kv_connector_of(llm).connector_scheduler.manager.core.counters

    reference, _ = run_with(tiny_model, workload, **ROOMY)
    got, seen = run_with(
        tiny_model, workload, inspect=counters, kv_transfer_config=kv_transfer_config(cfg), **ENGINE
    )
    assert refused["store"] > 0 and refused["load"] > 0, (refused, calls)
    assert seen.store_failures > 0, "refused stores were not dropped by the manager"
    cmp = compare_outputs(reference.outputs, got.outputs)
    assert cmp.identical, cmp.report()
