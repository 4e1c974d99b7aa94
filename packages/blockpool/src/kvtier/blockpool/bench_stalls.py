"""The longest single call of a full pool, where a call could go over the whole cache.

    python -m kvtier.blockpool.bench_stalls [--blocks 10000 100000] [--json PATH]

On the engine's scheduler thread one slow call is one slow step, however fast the
calls are on average: this program times each call on its own and gives the longest
and the median, for each scenario, pool size and eviction policy, beside vLLM's
``CPUOffloadingManager`` in the same scenario where vLLM has the same calls:

* ``pinned``: a full pool whose oldest three quarters are pinned (a slow tier's pending
  writes hold them; in vLLM's manager, loads), so that an eviction meets them first,
  then stores of 16 blocks, each completed before the next (timed: ``prepare_store``,
  which evicts);
* ``scattered``: every other block of the pool free (stores that failed), then stores
  of 16 blocks and one of 1,024 taking them (timed: ``prepare_store``);
* ``halving`` (frecency): a full pool, then three times the halving of every use count
  that the policy makes when LRU would have served more reuses, each followed by the
  stores of 16 blocks (completed) up to the next tuning, a pool's worth (timed: the
  tunings and the stores, where a pool from ``INCREMENTAL_KEYS`` blocks on builds the
  next halving's queues).

The garbage the setup leaves is collected before the timed calls: a collection visits
every object the process tracks, and one landing in a timed call would be the setup's
cost, not the call's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.blockpool.bench import VLLM_POLICY, make_keys, vllm_available
from kvtier.blockpool.holds import Hold
from kvtier.blockpool.pool import HostBlockPool

POLICIES = ("lru", "arc", "frecency")
ROUNDS = 30  # timed stores per scenario
REQUEST = 16  # blocks a store takes
MIN_BLOCKS = 8 * REQUEST * ROUNDS // 2  # (the unpinned quarter outlasts the rounds)


def _ms(seconds: Sequence[float]) -> tuple[float, float]:
    return max(seconds) * 1e3, statistics.median(seconds) * 1e3


def _timed(calls: Sequence[Callable[[], Any]]) -> list[float]:
    clock, out = time.perf_counter, []
    for call in calls:
        t0 = clock()
        call()
        out.append(clock() - t0)
    return out


class _Kvtier:
    def __init__(self, blocks: int, policy: str) -> None:
        self.pool = HostBlockPool(blocks, eviction_policy=policy)

    def fill(self, keys: list[bytes]) -> None:
        pool = self.pool
        for i in range(0, len(keys), REQUEST):
            request = keys[i : i + REQUEST]
            assert pool.prepare_store(request) is not None
            pool.complete_store(request)  # (no request's end: no use counted, as in vLLM's)

    def pin(self, keys: list[bytes]) -> None:
        self.pool.hold(keys, Hold.TIER_WRITE)

    def store(self, keys: list[bytes]) -> Callable[[], Any]:
        return lambda: self.pool.prepare_store(keys)

    def complete(self, keys: list[bytes], success: bool = True) -> None:
        self.pool.complete_store(keys, success=success)


class _Vllm:
    def __init__(self, blocks: int, policy: str) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self.mgr: Any = CPUOffloadingManager(
            num_chunks=blocks, cache_policy=VLLM_POLICY.get(policy, policy)
        )
        self.ctx = ReqContext(req_id="bench")

    def fill(self, keys: list[bytes]) -> None:
        mgr, ctx = self.mgr, self.ctx
        for i in range(0, len(keys), REQUEST):
            request = keys[i : i + REQUEST]
            assert mgr.prepare_store(request, ctx) is not None
            mgr.complete_store(request, ctx)

    def pin(self, keys: list[bytes]) -> None:
        self.mgr.prepare_load(keys, self.ctx)

    def store(self, keys: list[bytes]) -> Callable[[], Any]:
        return lambda: self.mgr.prepare_store(keys, self.ctx)

    def complete(self, keys: list[bytes], success: bool = True) -> None:
        self.mgr.complete_store(keys, self.ctx, success=success)


def pinned(side: Any, blocks: int) -> list[float]:
    keys = make_keys(blocks + ROUNDS * REQUEST)
    side.fill(keys[:blocks])
    side.pin(keys[: blocks * 3 // 4])
    gc.collect()
    times = []
    for r in range(ROUNDS):
        new = keys[blocks + r * REQUEST : blocks + (r + 1) * REQUEST]
        times += _timed([side.store(new)])
        side.complete(new)
    return times


def scattered(side: Any, blocks: int) -> list[float]:
    keys = make_keys(blocks + ROUNDS * REQUEST + 1024)
    own = keys[:blocks]
    for i in range(0, blocks, REQUEST):
        assert side.store(own[i : i + REQUEST])() is not None
    side.complete(own[1::2])
    side.complete(own[0::2], success=False)  # every other block free again
    more = keys[blocks:]
    calls = [side.store(more[i : i + REQUEST]) for i in range(0, ROUNDS * REQUEST, REQUEST)]
    if blocks // 2 >= ROUNDS * REQUEST + 1024:
        calls.append(side.store(more[ROUNDS * REQUEST :]))
    gc.collect()
    return _timed(calls)


def halving(side: Any, blocks: int) -> list[float]:
    pool = side.pool
    keys = make_keys(blocks * 4)
    side.fill(keys[:blocks])
    pool.touch(keys[:blocks:3])
    policy: Any = pool.policy

    def store(request: list[bytes]) -> Callable[[], None]:
        def call() -> None:
            assert pool.prepare_store(request) is not None
            pool.complete_store(request)

        return call

    gc.collect()
    times = []
    for round_ in range(3):
        policy._lead = -1  # LRU would have served more reuses: the tuning halves
        times += _timed([policy._tune])
        new = keys[blocks * (round_ + 1) : blocks * (round_ + 2)]
        times += _timed([store(new[i : i + REQUEST]) for i in range(0, blocks, REQUEST)])
    return times


SCENARIOS: dict[str, Callable[[Any, int], list[float]]] = {
    "pinned": pinned,
    "scattered": scattered,
    "halving": halving,
}


def measure(sizes: Sequence[int], with_vllm: bool) -> list[dict[str, Any]]:
    rows = []
    for scenario, run in SCENARIOS.items():
        for blocks in sizes:
            for policy in ("frecency",) if scenario == "halving" else POLICIES:
                row: dict[str, Any] = {"scenario": scenario, "blocks": blocks, "policy": policy}
                row["kvtier_max_ms"], row["kvtier_median_ms"] = _ms(
                    run(_Kvtier(blocks, policy), blocks)
                )
                if with_vllm and scenario != "halving":
                    row["vllm_max_ms"], row["vllm_median_ms"] = _ms(
                        run(_Vllm(blocks, policy), blocks)
                    )
                rows.append(row)
                print(format_rows([row], header=False), file=sys.stderr, flush=True)
    return rows


def format_rows(rows: list[dict[str, Any]], header: bool = True) -> str:
    lines = []
    if header:
        lines.append(
            f"{'scenario':<11}{'blocks':>9} {'policy':<9}{'kvtier longest ms':>18}"
            f"{'median':>9}{'vLLM longest ms':>16}{'median':>9}"
        )
        lines.append("-" * len(lines[0]))
    for r in rows:
        vllm = f"{r['vllm_max_ms']:>16.2f}{r['vllm_median_ms']:>9.2f}" if "vllm_max_ms" in r else ""
        lines.append(
            f"{r['scenario']:<11}{r['blocks']:>9,} {r['policy']:<9}"
            f"{r['kvtier_max_ms']:>18.2f}{r['kvtier_median_ms']:>9.2f}{vllm}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.blockpool.bench_stalls", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--blocks", type=int, nargs="+", default=[10_000, 100_000], help="pool sizes"
    )
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--no-vllm", action="store_true", help="measure kvtier only")
    args = parser.parse_args(argv)
    if min(args.blocks) < MIN_BLOCKS:
        parser.error(f"--blocks: each size must be at least {MIN_BLOCKS}, got {min(args.blocks)}")
    rows = measure(args.blocks, not args.no_vllm and vllm_available())
    print(format_rows(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
