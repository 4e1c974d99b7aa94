"""Every way to misuse the engine is a ValueError before any byte moves; failed copies are
reported on the handle, never raised."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.npu_copy import DependencyFailed, KVLayout, TransferEngine

from .layouts import NUM_BLOCKS, make_layout


def _engine(**kwargs: object) -> tuple[TransferEngine, torch.Tensor]:
    case = make_layout("per_layer")
    layout = KVLayout.from_kv_caches(case.kv)
    host = torch.zeros((8, layout.block_bytes), dtype=torch.uint8)
    return TransferEngine(layout, host, **kwargs), host  # type: ignore[arg-type]


# -- transfers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("direction", "device_ids", "host_ids", "message"),
    [
        ("store", [NUM_BLOCKS], [0], "device block id 12 is out of range"),
        ("store", [-1], [0], "device block id -1 is out of range"),
        ("store", [0], [8], "host block id 8 is out of range"),
        ("load", [0], [-2], "host block id -2 is out of range"),
        ("store", [0, 1], [3, 3], "destination host block id 3 appears more than once"),
        ("load", [4, 4], [0, 1], "destination device block id 4 appears more than once"),
        ("store", [0, 1], [0], "2 device block ids but 1 host block ids"),
        ("load", [0], [0, 1], "1 device block ids but 2 host block ids"),
        ("store", [0.5], [0], "must be integers"),
        ("store", torch.tensor([[0]]), [0], "1-D integer tensor"),
    ],
)
def test_bad_ids_raise_before_any_byte_moves(
    direction: str, device_ids: object, host_ids: object, message: str
) -> None:
    engine, host = _engine()
    with engine:
        kv_before = [s.rows.clone() for s in engine.layout.segments]
        with pytest.raises(ValueError, match=message):
            if direction == "store":
                engine.store(device_ids, host_ids)  # type: ignore[arg-type]
            else:
                engine.load(host_ids, device_ids)  # type: ignore[arg-type]
        assert engine.in_flight() == [], "a rejected transfer was submitted"
    assert int(host.count_nonzero()) == 0, "host blocks changed although the call raised"
    for seg, before in zip(engine.layout.segments, kv_before):
        assert torch.equal(seg.rows, before), f"device segment {seg.name} changed"


def test_duplicate_source_blocks_are_allowed() -> None:
    engine, host = _engine()
    with engine:
        assert engine.store([2, 2], [0, 1]).wait()
    assert torch.equal(host[0], host[1])


# -- registration ------------------------------------------------------------------------


def test_host_blocks_must_be_on_the_host() -> None:
    case = make_layout("per_layer")
    meta_host = torch.empty((4, 1 << 20), dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="must be on the host"):
        TransferEngine(case.kv, meta_host)


def test_host_blocks_must_be_uint8() -> None:
    case = make_layout("per_layer")
    with pytest.raises(ValueError, match="must be uint8"):
        TransferEngine(case.kv, torch.zeros((4, 1 << 18), dtype=torch.float32))


def test_host_blocks_must_be_2d() -> None:
    case = make_layout("per_layer")
    with pytest.raises(ValueError, match="must be 2-D"):
        TransferEngine(case.kv, torch.zeros(1 << 20, dtype=torch.uint8))


def test_host_block_too_small_for_the_layout() -> None:
    case = make_layout("per_layer")
    need = KVLayout.from_kv_caches(case.kv).block_bytes
    with pytest.raises(ValueError, match=f"smaller than one KV block of this layout \\({need}"):
        TransferEngine(case.kv, torch.zeros((4, need - 1), dtype=torch.uint8))


def test_host_block_rows_must_be_contiguous() -> None:
    case = make_layout("per_layer")
    need = KVLayout.from_kv_caches(case.kv).block_bytes
    strided = torch.zeros((need, 4), dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="contiguous rows"):
        TransferEngine(case.kv, strided)


def test_kv_tensors_on_mixed_devices() -> None:
    kv = [torch.zeros(4, 8), torch.zeros(4, 8, device="meta")]
    with pytest.raises(ValueError, match="different devices"):
        KVLayout.from_kv_caches(kv)


def test_first_dim_not_a_multiple_of_num_blocks() -> None:
    with pytest.raises(ValueError, match="not a multiple of num_blocks=4"):
        KVLayout.from_kv_caches([torch.zeros(6, 8)], num_blocks=4)


def test_different_first_dims_need_num_blocks() -> None:
    with pytest.raises(ValueError, match="pass num_blocks"):
        KVLayout.from_kv_caches([torch.zeros(4, 8), torch.zeros(8, 8)])


def test_partially_overlapping_tensors_are_rejected() -> None:
    raw = torch.zeros(10, 8)
    with pytest.raises(ValueError, match="overlap"):
        KVLayout.from_kv_caches([raw[0:8], raw[2:10]], num_blocks=8)


def test_non_dense_views_are_rejected() -> None:
    with pytest.raises(ValueError, match="not a permutation of a dense tensor"):
        KVLayout.from_kv_caches([torch.zeros(4, 8)[:, ::2]])


def test_cpu_backend_needs_host_kv() -> None:
    case = make_layout("per_layer")
    layout = KVLayout.from_kv_caches(case.kv)
    with pytest.raises(ValueError, match="backend must be one of"):
        TransferEngine(
            layout, torch.zeros((2, layout.block_bytes), dtype=torch.uint8), backend="dma"
        )


def test_shared_tensors_count_once() -> None:
    case = make_layout("shared")
    layout = KVLayout.from_kv_caches(case.kv)
    assert len(layout.segments) == 2
    assert layout.block_bytes == sum(t[0].numel() * t.element_size() for t in case.tensors)


def test_overlaid_kv_cache_groups_give_one_segment_per_page() -> None:
    case = make_layout("hybrid_overlay")
    layout = KVLayout.from_kv_caches(case.kv, NUM_BLOCKS)
    page = case.tensors[0][0].numel() * case.tensors[0].element_size()
    assert [s.block_bytes for s in layout.segments] == [page, page], layout.segments
    assert [s.rows.data_ptr() for s in layout.segments] == [t.data_ptr() for t in case.tensors]


def test_padded_views_hold_only_their_bytes() -> None:
    # A state view whose blocks lie further apart than its own bytes (a padded page).
    raw = torch.zeros(6 * 64, dtype=torch.uint8)
    state = raw.view(torch.float32).as_strided((6, 3, 4), (16, 4, 1), 2)
    layout = KVLayout.from_kv_caches([state])
    (segment,) = layout.segments
    assert (segment.block_bytes, segment.rows.stride(0)) == (48, 64)
    assert segment.rows.data_ptr() == raw.data_ptr() + 8


def test_views_into_other_blocks_of_a_shared_buffer_are_rejected() -> None:
    raw = torch.zeros(8 * 64, dtype=torch.uint8)
    pages = raw.view(8, 64)
    shifted = raw[32 : 32 + 7 * 64].as_strided((7, 48), (64, 1))  # straddles two pages
    with pytest.raises(ValueError, match="overlap"):
        KVLayout.from_kv_caches({"a": pages[:7], "b": shifted}, num_blocks=7)


def test_layout_units() -> None:
    kv = {"a": torch.zeros(5, 2, 16, 8, dtype=torch.float16), "b": torch.zeros(10, 16)}
    layout = KVLayout.from_kv_caches(kv, num_blocks=5, segment_alignment=256)
    assert [s.block_bytes for s in layout.segments] == [512, 64, 64]
    assert [s.host_offset for s in layout.segments] == [0, 512, 768]
    assert layout.block_bytes == 832


# -- failures ----------------------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [True, False])
def test_failed_copy_is_reported_on_the_handle(
    monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    engine, _ = _engine(asynchronous=asynchronous)
    with engine:

        def broken(*args: object, **kwargs: object) -> None:
            raise OSError("injected copy failure")

        monkeypatch.setattr(engine._backend, "_copy", broken)
        handle = engine.store([0, 1], [0, 1])
        assert handle.wait() is False
        assert handle.done() and not handle.ok
        assert isinstance(handle.error, OSError) and "injected" in str(handle.error)


def test_stream_path_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = _engine(backend="stream")
    with engine:

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected DMA failure")

        monkeypatch.setattr(engine._backend, "dma", broken)
        handle = engine.load([0], [3])
        assert not handle.wait() and "injected" in str(handle.error)


def test_load_of_a_failed_store_fails_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that reads host blocks a failed store is still writing must not report
    success (asynchronous copies: the store is in flight when the load is submitted)."""
    engine, _ = _engine(asynchronous=True)
    with engine:
        release = threading.Event()

        def slow_broken(*args: object, **kwargs: object) -> None:
            release.wait(5)
            raise OSError("injected copy failure")

        monkeypatch.setattr(engine._backend, "_copy", slow_broken)
        store = engine.store([0, 1], [5, 6])
        monkeypatch.undo()
        load = engine.load([6], [9])
        release.set()
        assert not store.wait()
        assert not load.wait()
        assert isinstance(load.error, DependencyFailed)


def test_engine_keeps_working_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = _engine()
    with engine:
        with monkeypatch.context() as m:
            m.setattr(engine._backend, "_copy", lambda *a, **k: 1 / 0)
            assert not engine.store([0], [0]).wait()
        assert engine.store([0], [0]).wait()
