"""The scheduler thread's cost of each block written through to the fs tier.

A tier manager with a host tier of 256 blocks (frecency, full after the first rounds,
so every store evicts) and one fs tier in a temporary folder stores rounds of new
keys. Each round is timed in the calling thread's CPU time, in its four parts: the
store (``prepare_store``: the host blocks, evictions included), its completion (the
write-through: digests, holds, the job), the end of the step that submits the job,
and the end of a step after the writes landed (the poll: the fs index, the results,
the holds released). The fs tier's own threads do the I/O; their time is not counted.

    python packages/tiering-spec/scripts/fs_write_path.py [--rounds N] [--keys K] [--runs R]

Prints µs per block for each part, the best of ``--runs`` runs (the least disturbed
by the machine's other work).
"""

from __future__ import annotations

import argparse
import mmap
import tempfile
import time

from kvtier.blockpool import HostBlockPool
from kvtier.tiering_spec.config import FsTierConfig
from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

HOST_BLOCKS = 256
PAYLOAD = 4096  # bytes of a host block (the I/O is off the measured thread)
PARTS = ("store", "complete", "submit", "poll")


def run(rounds: int, per_round: int) -> dict[str, float]:
    """µs per block of each part over ``rounds`` rounds of ``per_round`` new keys."""
    region = mmap.mmap(-1, HOST_BLOCKS * PAYLOAD)
    layout = [{"model": "fs-write-path", "dtype": "float32", "rank": 0, "world_size": 1}]
    with tempfile.TemporaryDirectory(prefix="kvtier-fs-write-path-") as root:
        cfg = FsTierConfig(root_dir=root, n_read_threads=2, n_write_threads=2)
        tier = FileSystemTier(cfg, layout, PAYLOAD, lambda: [memoryview(region)])
        try:
            tier.wait_scan(30)
            mgr = TierManager(HostBlockPool(HOST_BLOCKS), [tier])
            spent = dict.fromkeys(PARTS, 0)
            blocks = 0
            clock = time.thread_time_ns
            for r in range(rounds):
                keys = [b"%08d-%04d" % (r, i) + bytes(24) for i in range(per_round)]
                t = clock()
                plan = mgr.prepare_store(keys)
                spent["store"] += clock() - t
                if plan is None:  # (the writes in flight hold the room: wait for them)
                    mgr.drain(5.0)
                    mgr.end_step()
                    continue
                t = clock()
                mgr.complete_store(plan[0])
                spent["complete"] += clock() - t
                t = clock()
                mgr.end_step()
                spent["submit"] += clock() - t
                blocks += len(plan[0])
                deadline = time.monotonic() + 5.0
                while len(tier._results) < len(plan[0]) and time.monotonic() < deadline:
                    time.sleep(0.0005)
                t = clock()
                mgr.end_step()
                spent["poll"] += clock() - t
        finally:
            tier.shutdown()
    return {part: ns / max(1, blocks) / 1000.0 for part, ns in spent.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="stores per run (300)")
    parser.add_argument("--keys", type=int, default=24, help="new keys per store (24)")
    parser.add_argument("--runs", type=int, default=3, help="runs, the best kept (3)")
    opts = parser.parse_args(argv)
    for name in ("rounds", "keys", "runs"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(opts, name)}")
    if opts.keys > HOST_BLOCKS // 2:
        parser.error(f"--keys must be at most {HOST_BLOCKS // 2}, got {opts.keys}")
    runs = [run(opts.rounds, opts.keys) for _ in range(opts.runs)]
    best = min(runs, key=lambda r: sum(r.values()))
    print(f"{'part':<10}{'µs/block':>10}")
    for part in PARTS:
        print(f"{part:<10}{best[part]:>10.2f}")
    print(f"{'total':<10}{sum(best.values()):>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
