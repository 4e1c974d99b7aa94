"""Two engines' fs tiers on one root_dir never read a half-written file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = r"""
import json, mmap, random, sys, time
from kvtier.tiering_spec.config import FsTierConfig
from kvtier.tiering_spec.tiers.fs.format import key_digest
from kvtier.tiering_spec.tiers.fs.tier import FileSystemTier

root, me, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
PAYLOAD, BLOCKS, KEYS = 64 * 1024, 16, 24
region = mmap.mmap(-1, PAYLOAD * BLOCKS)
view = memoryview(region)
tier = FileSystemTier(
    FsTierConfig(root_dir=root, n_read_threads=2, n_write_threads=2),
    [{"model": "shared", "rank": 0, "world_size": 1}],
    PAYLOAD,
    lambda: [view],
)

def content(i):
    return (i.to_bytes(4, "little") * (PAYLOAD // 4))

keys = [b"key-%d" % i for i in range(KEYS)]
good = bad = reads = writes = 0
end = time.monotonic() + seconds
n = 0
rng = random.Random(me)
while time.monotonic() < end:
    n += 1
    i = rng.randrange(KEYS)
    block = n % BLOCKS
    d = key_digest(keys[i])
    if rng.random() < 0.4:
        # rewrite (also files the other process wrote): forget, write again
        tier._forget(d, None, unlink=False)
        view[block * PAYLOAD:(block + 1) * PAYLOAD] = content(i)
        if tier.submit_write(keys[i], d, block):
            writes += 1
    elif tier.contains(d) and tier.submit_read(keys[i], d, block):
        reads += 1
    tier.drain()
    for res in tier.poll():
        if res.op == "read" and res.ok:
            got = bytes(view[res.block_id * PAYLOAD:(res.block_id + 1) * PAYLOAD])
            ok = got == content(keys.index(res.key))
            good += ok
            bad += not ok
tier.shutdown()
summary = {"good": good, "bad": bad, "reads": reads, "writes": writes}
print(json.dumps({**summary, "faults": tier.faults()}))
"""


@pytest.mark.slow
def test_two_processes_on_one_root_dir_never_read_a_partial_file(tmp_path: Path) -> None:
    root = str(tmp_path / "shared")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, root, str(me), "4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["bad"] == 0, f"a read returned wrong bytes: {r}"
        assert r["faults"]["corrupt"] == 0 and r["faults"]["truncated"] == 0, r
        assert r["good"] > 0 and r["writes"] > 0, r
