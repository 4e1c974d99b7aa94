"""The compiled piece copier: built on first use where no wheel shipped it, byte-exact,
and optional. (Which library loads, and the build lock: test_native_load.py.)"""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch

from kvtier.npu_copy import TransferEngine, native
from kvtier.npu_copy.cpu_backend import PARALLEL_MIN_BYTES, STREAM_MIN_BYTES

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")


@needs_cc
def test_builds_into_the_cache_on_first_use(fresh_native, tmp_path) -> None:
    fn = native.load()
    assert fn is not None
    built = list((tmp_path / "cache" / "native").glob("copy_pieces-*.so"))
    assert len(built) == 1
    assert native.load() is fn  # loaded once per process
    assert (native.source(), native.library_file()) == ("built", built[0])


def test_a_broken_compiler_leaves_the_portable_path(fresh_native, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="kvtier.npu_copy.native"):
        assert native.load() is None
    assert "native copy unavailable" in caplog.text
    kv, host = _odd_layout(layers=2, piece=4136)
    with TransferEngine(kv, host) as eng:
        assert eng._backend._native is None  # type: ignore[attr-defined]
        _check_round_trip(eng, kv, host, [5, 1, 9], [3, 7, 0])


def test_switched_off_by_environment(fresh_native, monkeypatch) -> None:
    monkeypatch.setenv("KVTIER_NATIVE_COPY", "0")
    assert native.load() is None
    assert (native.source(), native.library_file()) == ("none", None)


def _odd_layout(
    layers: int, piece: int, blocks: int = 24
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """uint8 KV tensors whose pieces are not a multiple of 16 bytes, so host offsets of
    every segment but the first are unaligned (the copier's head and tail paths)."""
    gen = torch.Generator().manual_seed(7)
    kv = [
        torch.randint(0, 256, (blocks, piece), dtype=torch.uint8, generator=gen)
        for _ in range(layers)
    ]
    host = torch.zeros((blocks, layers * piece), dtype=torch.uint8)
    return kv, host


def _check_round_trip(
    eng: TransferEngine, kv: list[torch.Tensor], host: torch.Tensor, src: list[int], dst: list[int]
) -> None:
    piece = kv[0].shape[1]
    hosts = list(range(len(src)))[::-1]  # scattered on the host side too: 2, 1, 0 ...
    hosts = [h * 2 + 1 for h in hosts]
    want = [t[src].clone() for t in kv]
    assert eng.store(src, hosts).wait()
    for i, t in enumerate(kv):
        assert torch.equal(host[hosts, i * piece : (i + 1) * piece], want[i])
        t[dst] = 0
    assert eng.load(hosts, dst).wait()
    for i, t in enumerate(kv):
        assert torch.equal(t[dst], want[i]), f"layer {i} differs after the load"


@needs_cc
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "portable"])
@pytest.mark.parametrize(
    ("layers", "piece", "n"),
    [
        (64, 4136, 16),  # >= STREAM_MIN_BYTES: streamed stores, split over the copy threads
        (8, 65536 + 40, 6),  # threaded, cached stores
        (3, 100, 5),  # tiny pieces below the streaming cut-off, one thread
    ],
)
def test_scattered_copies_are_byte_exact(
    fresh_native, use_native: bool, layers: int, piece: int, n: int
) -> None:
    kv, host = _odd_layout(layers, piece, blocks=2 * n + 2)
    total = layers * piece * n
    assert (total >= STREAM_MIN_BYTES) == (layers == 64)
    assert (total >= PARALLEL_MIN_BYTES) == (layers != 3)
    src = [2 * i + 1 for i in range(n)][::-1]  # scattered: no run for the strided path
    dst = [2 * i for i in range(n)]
    with TransferEngine(kv, host, cpu_threads=2, cpu_native=use_native) as eng:
        assert (eng._backend._native is not None) == use_native  # type: ignore[attr-defined]
        _check_round_trip(eng, kv, host, src, dst)


@needs_cc
def test_a_damaged_cached_library_is_built_again(fresh_native) -> None:
    # (Damaged before this process maps it: rewriting a mapped library in place would
    # fault the process, which is why builds only ever rename a new file into place.)
    cc = native.compiler()
    assert cc is not None
    path = native.library_path(cc)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    assert native.load() is not None
    assert path.read_bytes()[:4] == b"\x7fELF"


@needs_cc
def test_a_stale_library_that_loads_is_replaced(fresh_native, tmp_path) -> None:
    """A cached library of another ABI loads but is refused; the rebuilt one is used even
    though this process already mapped the stale one under the same name."""
    cc = native.compiler()
    assert cc is not None
    path = native.library_path(cc)
    path.parent.mkdir(parents=True)
    src = tmp_path / "stale.c"
    src.write_text("int kvtier_copy_abi_version(void) { return 999; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    fn = native.load()
    assert fn is not None
    assert fn.argtypes is not None and len(fn.argtypes) == 11


@needs_cc
def test_a_cache_directory_others_can_write_is_not_used(fresh_native, tmp_path, caplog) -> None:
    shared = tmp_path / "cache" / "native"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvtier.npu_copy.native"):
        assert native.load() is None
    assert "not private" in caplog.text
    assert not list(shared.iterdir())
