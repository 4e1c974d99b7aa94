"""The scheduler-step mode of the pool benchmark replays vLLM 0.23's calls."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvtier.blockpool import HostBlockPool, bench


def test_step_replay_touches_whole_contexts_and_reports_each_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    touched: list[list[bytes]] = []
    plain_touch = HostBlockPool.touch

    def recording_touch(pool: HostBlockPool, keys: Sequence[bytes]) -> None:
        assert all(pool.contains(k) for k in keys), "a touched key was not cached"
        touched.append(list(keys))
        plain_touch(pool, keys)

    monkeypatch.setattr(HostBlockPool, "touch", recording_touch)
    # 8 requests, 256 tokens of context, blocks of 32 tokens: 8 blocks cached each;
    # every request stores two blocks, touching its 9 and then its 10 keys.
    result = bench.measure_steps((8, 256, 32), with_vllm=False, repeats=1)
    pools = len(bench.STEP_POLICIES)  # each pool replays the same calls
    assert sorted(len(keys) for keys in touched) == [9] * 8 * pools + [10] * 8 * pools
    firsts = {keys[0] for keys in touched}
    assert len(firsts) == 8, "each request touches its own keys, its prefix first"
    assert result["keys_touched_per_step"] == 8 * (8 + 1.5) / 32
    assert result["kvtier_store_us"] > 0 and result["kvtier_touch_us"] > 0
    assert result["frecency_store_us"] > 0 and result["frecency_touch_us"] > 0
    assert "vllm_touch_us" not in result, "vLLM was not asked for"


def test_step_table_has_a_row_per_shape() -> None:
    row = {"keys_touched_per_step": 9.5, "kvtier_store_us": 2.0, "kvtier_touch_us": 4.0}
    table = bench.format_steps([((8, 256, 32), row), ((16, 512, 32), row)])
    lines = table.splitlines()
    assert lines[0].startswith("microseconds per scheduler step")
    assert len(lines) == 3 + 2, table
    assert "vLLM touch" not in table
