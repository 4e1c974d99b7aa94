"""Real traffic through ``vllm serve``: a window of a production request trace, replayed.

    python -m kvtier.demo.bench_trace [--trace PATH] [--json OUT] [--smoke] [...]

The trace is Mooncake's conversation trace (FAST'25; one JSON object a line with
``timestamp`` in ms, ``input_length``, ``output_length`` and ``hash_ids``, the prompt's
512-token blocks as integers that form a prefix tree). ``--trace PATH`` reads any file
of that format (gzip, xz and bzip2 are decompressed); without it the copy packaged in
kvtier-tiering-spec is read. Both go through kvtier-tiering-spec's validating loader
(``kvtier.tiering_spec.tracefile.load_trace``), which names the line of a bad input.

The window:

* a time span of the trace (``--start``, ``--seconds``), sampled by conversation: a
  request is kept when its conversation (its second block id: every prompt starts with
  the same system-prompt block) hashes below ``--sample``. Sampling whole conversations
  keeps the trace's reuse (turns that come back minutes later, blocks used once) while
  cutting the volume, and shrinks reuse distances by the same factor, so a host tier of
  C blocks here behaves like one of C / sample blocks on the whole trace;
* each block id becomes the same ``--tokens-per-block`` random tokens (seeded)
  wherever it appears, so real prefixes share real KV; prompts are cut to
  ``--max-blocks`` blocks (a prefix of a prefix is still one) and outputs to
  ``--max-output`` tokens (greedy, EOS ignored);
* arrivals keep their order and gaps, divided by ``--speedup``, so a device cache of
  ``--device-blocks`` blocks is under pressure.

Each configuration runs on fresh ``vllm serve`` processes (the realistic-shaped
16-layer model of kvtier-testkit; ``--smoke``: a tiny model and window) with the
``openai`` client, asynchronous, each request sent at its arrival time and streamed:

* ``vLLM alone``: the device prefix cache only;
* ``host <policy>``: kvtier's ``CPUOffloadingSpec`` through vLLM's
  ``OffloadingConnector``, ``eviction_policy`` LRU and each name of ``--policies``
  (default: every policy kvtier's block pool has beyond ``lru`` and ``arc``);
* ``host + fs``: ``TieringOffloadingSpec``, the same host budget and an fs tier in a
  temporary folder (the first of ``--policies``, else LRU);
* two engines, requests routed round-robin: with private host tiers only
  (``TieringOffloadingSpec`` without secondary tiers), then with the same host tiers
  plus one shared Mooncake Store tier (a ``mooncake_master`` on
  loopback and a process that lends the store its memory, as the ``pd`` session does).
  Needs Mooncake's client (``mooncake-transfer-engine-non-cuda``); skipped with a note
  without it unless ``--require-mooncake``.

Reported per row: time to first token (TTFT, client side, p50 and p90), output tokens
per second over the replay, prefill tokens (the prompt tokens the engines computed:
vLLM's ``vllm:prompt_tokens_by_source{source="local_compute"}``, which counts each
request's first prefill after device prefix-cache and connector hits; the prompt that a
preempted request computes again is not in it, so preemptions are reported beside it),
tokens served by kvtier (``vllm:external_prefix_cache_hits``), and whether every
output equals vLLM alone's. Exits 1 if an output differs or a run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.tiering_spec.tracefile import DEFAULT_TRACE, TraceError, TraceRequest, load_trace

MOONCAKE_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (CPU; -npu on Ascend) and Debian's libibverbs1"
)


# -------------------------------------------------------------------------- window


@dataclass(frozen=True)
class Window:
    """Which requests of a trace are replayed, and how (see the module's doc)."""

    start_s: float = 0.0
    seconds: float = 720.0
    sample: float = 1 / 40
    speedup: float = 20.0
    max_blocks: int = 16
    max_output: int = 8
    tokens_per_block: int = 16
    seed: int = 0

    def keeps(self, req: TraceRequest) -> bool:
        if not req.hash_ids:  # a prompt shorter than a block: nothing to replay
            return False
        if not self.start_s * 1000 <= req.timestamp < (self.start_s + self.seconds) * 1000:
            return False
        if self.sample >= 1:
            return True
        # A conversation is its first block after the shared system prompt.
        root = req.hash_ids[1] if len(req.hash_ids) > 1 else req.hash_ids[0]
        digest = hashlib.blake2b(f"{self.seed}:{root}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") < self.sample * 2**64

    def select(self, trace: Sequence[TraceRequest]) -> list[Request]:
        kept = [r for r in trace if self.keeps(r)]
        if not kept:
            return []
        t0 = self.start_s * 1000
        return [
            Request(
                index=i,
                arrival_s=(r.timestamp - t0) / 1000 / self.speedup,
                hash_ids=r.hash_ids[: self.max_blocks],
                max_tokens=max(1, min(r.output_length, self.max_output)),
            )
            for i, r in enumerate(sorted(kept, key=lambda r: r.timestamp))
        ]


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    max_tokens: int


class BlockTokens:
    """Block id -> the same ``n`` random token ids wherever it appears (seeded)."""

    def __init__(self, n: int, vocab: int, seed: int, first_token: int = 3) -> None:
        self.n, self.vocab, self.seed, self.first_token = n, vocab, seed, first_token
        self._cache: dict[int, list[int]] = {}

    def __call__(self, block_id: int) -> list[int]:
        tokens = self._cache.get(block_id)
        if tokens is None:
            rng = random.Random(f"{self.seed}:{block_id}")
            # Ids below first_token are the tokenizer's specials.
            tokens = [rng.randrange(self.first_token, self.vocab) for _ in range(self.n)]
            self._cache[block_id] = tokens
        return tokens

    def prompt(self, hash_ids: Sequence[int]) -> list[int]:
        return [t for b in hash_ids for t in self(b)]


def reuse_share(requests: Sequence[Request]) -> float:
    """Share of prompt blocks an infinite cache serves (the longest cached prefix)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in requests:
        total += len(r.hash_ids)
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[: n + 1] in seen:
            n += 1
        hit += n
        seen.update(r.hash_ids[: k + 1] for k in range(len(r.hash_ids)))
    return hit / total if total else 0.0


# -------------------------------------------------------------------------- client


@dataclass
class Completion:
    index: int
    engine: int
    ttft_s: float
    seconds: float
    tokens: list[int]


@dataclass
class Replay:
    completions: list[Completion] = field(default_factory=list)
    wall_s: float = 0.0
    late_s: float = 0.0  # the most a request was sent after its arrival time
    errors: list[str] = field(default_factory=list)

    def outputs(self) -> list[list[int]]:
        return [c.tokens for c in sorted(self.completions, key=lambda c: c.index)]

    def ttft(self, q: float) -> float:
        return percentile([c.ttft_s for c in self.completions], q)

    def output_tokens_per_s(self) -> float:
        n = sum(len(c.tokens) for c in self.completions)
        return n / self.wall_s if self.wall_s else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Percentile ``q`` (0-100) with linear interpolation; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    if len(ordered) == 1:
        return ordered[0]
    return float(statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1])


async def _send(
    client: Any, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[int]]:
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            ids = getattr(choice, "token_ids", None) or []
            if ids and first is None:
                first = time.perf_counter() - start
            tokens.extend(int(i) for i in ids)
    if first is None:
        raise RuntimeError("the server streamed no token ids")
    return first, tokens


async def replay_async(
    base_urls: Sequence[str],
    model: str,
    requests: Sequence[Request],
    prompts: Sequence[list[int]],
    progress: Any = None,
) -> Replay:
    """Send every request at its arrival time to ``base_urls[i % len]`` (round-robin),
    streamed; a failed request is recorded in ``errors``."""
    import openai

    clients = [
        openai.AsyncOpenAI(base_url=u, api_key="unused", timeout=900, max_retries=0)
        for u in base_urls
    ]
    result = Replay()
    t0 = time.perf_counter()

    async def one(i: int, req: Request) -> None:
        delay = req.arrival_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        result.late_s = max(result.late_s, (time.perf_counter() - t0) - req.arrival_s)
        engine = i % len(clients)
        start = time.perf_counter()
        try:
            ttft, tokens = await _send(clients[engine], model, prompts[i], req.max_tokens)
        except Exception as exc:  # recorded; the run is then reported as failed
            result.errors.append(f"request {req.index}: {type(exc).__name__}: {exc}")
            return
        result.completions.append(
            Completion(req.index, engine, ttft, time.perf_counter() - start, tokens)
        )
        if progress is not None:
            progress.update(1)

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        for c in clients:
            await c.close()
    result.wall_s = time.perf_counter() - t0
    return result


# ---------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Setup:
    """Engine sizes (the realistic model, or the tiny one with ``--smoke``)."""

    model: dict[str, int]
    device_blocks: int
    host_mib: int
    fs_mib: int
    store_mib: int
    max_num_seqs: int
    max_num_batched_tokens: int


REALISTIC_MODEL = {"layers": 16, "hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64}
TINY_MODEL = {"layers": 2, "hidden": 128, "heads": 2, "head_dim": 64}
BLOCK_SIZE = 32

# The default window (54 requests, 9,456 prompt tokens; an infinite cache of 32-token
# blocks would serve 32% of them) replays in about a minute per configuration here.
# 32 device blocks hold 2-3 running requests and almost no cached prefix; a 64 MiB host
# tier (64 blocks of 1 MiB) serves about half of what an infinite one would with LRU
# (16% of prompt tokens in an offline replay), so a policy has room to do better.
FULL = Setup(
    model=REALISTIC_MODEL,
    device_blocks=32,
    host_mib=64,
    fs_mib=256,
    store_mib=1024,
    max_num_seqs=8,
    max_num_batched_tokens=512,
)
SMOKE = Setup(
    model=TINY_MODEL,
    device_blocks=16,
    host_mib=1,
    fs_mib=8,
    store_mib=64,
    max_num_seqs=4,
    max_num_batched_tokens=256,
)
SMOKE_WINDOW = Window(seconds=600, sample=1 / 100, speedup=200, max_blocks=8, max_output=4)


@dataclass
class Row:
    """One configuration: a kv-transfer config per engine (None: vLLM alone)."""

    label: str
    kind: str  # "alone", "host", "fs", "private", "shared"
    kv: list[dict[str, Any] | None]
    policy: str | None = None
    needs_store: bool = False


def offload_kv(
    spec: str, host_bytes: int, policy: str | None, tiers: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_bytes, "spec_name": spec}
    if policy is not None:
        extra["eviction_policy"] = policy
    if tiers:
        extra["secondary_tiers"] = tiers
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def new_policies() -> list[str]:
    """kvtier's policies beyond the LRU and ARC that vLLM has too."""
    try:
        from kvtier.blockpool.policies import POLICIES
    except ImportError:
        return []
    return [name for name in POLICIES if name not in ("lru", "arc")]


def spec_accepts(policy: str) -> bool:
    """Whether the tiering spec's configuration accepts ``eviction_policy=policy``."""
    try:
        from kvtier.tiering_spec.config import EVICTION_POLICIES
    except ImportError:
        return True
    return policy in EVICTION_POLICIES


def plan_rows(
    setup: Setup,
    policies: list[str],
    fs_root: str,
    store: dict[str, Any] | None,
    notes: list[str],
    only: set[str] | None,
) -> list[Row]:
    host = setup.host_mib << 20
    usable = []
    for p in policies:
        if p == "lru":
            continue
        if spec_accepts(p):
            usable.append(p)
        else:
            notes.append(f"host {p}: skipped, the tiering spec does not accept it yet")
    if not policies:
        notes.append(
            "host <new policy>: skipped, kvtier.blockpool.policies.POLICIES has no policy "
            "beyond lru and arc (name one with --policies)"
        )
    # The rows with secondary tiers take the first new policy.
    best = usable[0] if usable else "lru"
    fs_tier = [{"type": "fs", "root_dir": fs_root, "capacity_bytes": setup.fs_mib << 20}]
    rows = [
        Row("vLLM alone", "alone", [None]),
        Row("host lru", "host", [offload_kv("CPUOffloadingSpec", host, "lru")], "lru"),
        *[Row(f"host {p}", "host", [offload_kv("CPUOffloadingSpec", host, p)], p) for p in usable],
        Row(
            f"host {best} + fs",
            "fs",
            [offload_kv("TieringOffloadingSpec", host, best, fs_tier)],
            best,
        ),
        # The same spec class as the shared row, without the store: only the store differs.
        Row(
            f"2 engines, private host {best}",
            "private",
            [offload_kv("TieringOffloadingSpec", host, best)] * 2,
            best,
        ),
        Row(
            f"2 engines, host {best} + shared store",
            "shared",
            [offload_kv("TieringOffloadingSpec", host, best, [store or {}])] * 2,
            best,
            needs_store=True,
        ),
    ]
    return [r for r in rows if only is None or r.kind in only]


def engine_args(setup: Setup, max_model_len: int, kv: dict[str, Any] | None) -> list[str]:
    from kvtier.testkit.server import kv_transfer_arg

    args = [
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
        "--seed", "0", "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", "0.2",
        "--num-gpu-blocks-override", str(setup.device_blocks),
        "--max-num-seqs", str(setup.max_num_seqs),
        "--max-num-batched-tokens", str(setup.max_num_batched_tokens),
    ]  # fmt: skip
    return args + (kv_transfer_arg(kv) if kv is not None else [])


def _metric(text: str, name: str, **labels: str) -> float:
    from kvtier.testkit.server import prometheus_values

    total = 0.0
    for suffix in ("_total", ""):
        values = prometheus_values(text, name + suffix)
        for key, value in values.items():
            if all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        if values:
            break
    return total


def run_row(
    row: Row,
    model: Path,
    setup: Setup,
    max_model_len: int,
    requests: Sequence[Request],
    prompts: Sequence[list[int]],
    log_dir: Path,
    progress: Any,
) -> tuple[dict[str, Any], list[list[int]]]:
    """Start the row's servers (together), replay, read their metrics, stop them."""
    from kvtier.testkit.server import VllmServer

    env = {"PYTHONHASHSEED": "0"}  # one block-hash seed for every engine (shared store)
    slug = row.label.replace(" ", "-").replace(",", "").replace("+", "plus")
    servers = [
        VllmServer(
            model,
            engine_args(setup, max_model_len, kv),
            env=env,
            log_path=log_dir / f"bench-trace-{slug}-{i}.log",
        )
        for i, kv in enumerate(row.kv)
    ]
    started = time.perf_counter()
    try:
        # The engines start side by side; any that fails stops them all (finally).
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(s.start) for s in servers]:
                future.result()
        startup_s = time.perf_counter() - started
        result = asyncio.run(
            replay_async([s.base_url for s in servers], str(model), requests, prompts, progress)
        )
        texts = [s.metrics() for s in servers]
        for i, text in enumerate(texts):  # beside the server logs, for a closer look
            (log_dir / f"bench-trace-{slug}-{i}.metrics.txt").write_text(text)
    finally:
        for s in servers:
            s.stop()
    if result.errors:
        raise RuntimeError(f"{row.label}: {len(result.errors)} failed: {result.errors[0]}")

    def total(name: str, **labels: str) -> int:
        return int(sum(_metric(t, name, **labels) for t in texts))

    figures = {
        "run": row.label,
        "kind": row.kind,
        "policy": row.policy,
        "engines": len(servers),
        "ttft_p50_s": round(result.ttft(50), 3),
        "ttft_p90_s": round(result.ttft(90), 3),
        "output_tok_s": round(result.output_tokens_per_s(), 1),
        "prefill_tokens": total("vllm:prompt_tokens_by_source", source="local_compute"),
        "prompt_tokens": total("vllm:prompt_tokens"),
        "device_hit_tokens": total("vllm:prompt_tokens_by_source", source="local_cache_hit"),
        "kvtier_tokens": total("vllm:external_prefix_cache_hits"),
        "preemptions": total("vllm:num_preemptions"),
        "replay_s": round(result.wall_s, 1),
        "startup_s": round(startup_s, 1),
        "late_s": round(result.late_s, 2),
    }
    return figures, result.outputs()


# ------------------------------------------------------------------ Mooncake Store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mooncake_available() -> str | None:
    """None when Mooncake's store client imports; else why not."""
    try:
        importlib.import_module("mooncake.store")
    except Exception as exc:  # ImportError, or a missing libibverbs
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def mooncake_store(lend_bytes: int, log_dir: Path) -> Iterator[dict[str, Any]]:
    """A ``mooncake_master`` with its HTTP metadata server on loopback and a process that
    lends the store ``lend_bytes``; yields the store tier entry for engines. Both are
    stopped on exit."""
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).with_name("mooncake_master"))
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    meta = f"http://127.0.0.1:{http}/metadata"
    procs: list[subprocess.Popen[bytes]] = []
    with open(log_dir / "bench-trace-mooncake-master.log", "wb") as log:
        procs.append(
            subprocess.Popen(
                [
                    exe, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={http}", f"--metrics_port={metrics}",
                ],
                stdout=log, stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", rpc), timeout=0.2).close()
                break
            except OSError:
                if procs[0].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mooncake_master did not start") from None
                time.sleep(0.1)
        code = (
            "import sys, time\n"
            "from mooncake.store import MooncakeDistributedStore as S\n"
            "s = S()\n"
            "for _ in range(100):\n"
            f"    rc = s.setup('127.0.0.1', '{meta}', {lend_bytes}, 16 << 20, 'tcp', '', "
            f"'127.0.0.1:{rpc}')\n"
            "    if rc == 0: break\n"
            "    time.sleep(0.1)\n"
            "print('lending', rc, flush=True)\n"
            "time.sleep(86400)\n"
        )
        lender = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        procs.append(lender)
        assert lender.stdout is not None
        line = lender.stdout.readline().decode().strip()
        if line != "lending 0":
            raise RuntimeError(f"the process lending memory to the store did not start: {line!r}")
        yield {
            "type": "mooncake",
            "master_server_address": f"127.0.0.1:{rpc}",
            "metadata_server": meta,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,  # the lender holds the objects
            "local_buffer_size": 16 << 20,
        }
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


# ------------------------------------------------------------------------- report

COLUMNS = [
    ("run", "run"),
    ("TTFT p50 s", "ttft_p50_s"),
    ("TTFT p90 s", "ttft_p90_s"),
    ("x alone (p50)", "vs_alone"),
    ("out tok/s", "output_tok_s"),
    ("prefill tok", "prefill_tokens"),
    ("device hit tok", "device_hit_tokens"),
    ("kvtier tok", "kvtier_tokens"),
    ("preempt", "preemptions"),
    ("replay s", "replay_s"),
    ("outputs", "identical"),
]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], key: str) -> str:
        value = r.get(key)
        if key == "identical":
            return "-" if value is None else ("match" if value else "DIFFER")
        return "-" if value is None else str(value)

    cells = [[cell(r, k) for _, k in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(COLUMNS)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))
        )

    return "\n".join([line([h for h, _ in COLUMNS]), *(line(c) for c in cells)])


def goals(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> list[dict[str, Any]]:
    """Item 4's and item 5's goals with the measured values (None: not measured)."""
    by_run = {r["run"]: r for r in rows}
    alone = by_run.get("vLLM alone")
    lru = by_run.get("host lru")
    new = next((by_run[f"host {p}"] for p in policies if f"host {p}" in by_run), None)
    private = next((r for r in rows if r["kind"] == "private"), None)
    shared = next((r for r in rows if r["kind"] == "shared"), None)

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
        if a is None or b is None or not b[key]:
            return None
        return round(a[key] / b[key], 3)

    def goal(text: str, value: float | None, target: float, at_most: bool) -> dict[str, Any]:
        met = value is not None and (value <= target if at_most else value >= target)
        sign = "<=" if at_most else ">="
        return {"goal": text, "value": value, "target": f"{sign} {target}", "met": met}

    name = new["policy"] if new else "<new policy>"
    return [
        goal(f"TTFT p50, vLLM alone / host {name}", ratio(alone, new, "ttft_p50_s"), 2.0, False),
        goal(
            f"prefill tokens, host {name} / host lru",
            ratio(new, lru, "prefill_tokens"),
            1.0,
            True,
        ),
        goal(
            "two engines: prefill tokens, shared store / private host tiers",
            ratio(shared, private, "prefill_tokens"),
            1.0,
            True,
        ),
        goal(
            "two engines: TTFT p50, shared store / private host tiers",
            ratio(shared, private, "ttft_p50_s"),
            1.0,
            True,
        ),
    ]


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Window()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", help="trace file (default: the one kvtier-tiering-spec ships)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="a tiny model and window (CI)")
    p.add_argument("--start", type=float, help=f"window start, trace seconds ({d.start_s:g})")
    p.add_argument("--seconds", type=float, help=f"window length, trace seconds ({d.seconds:g})")
    p.add_argument("--sample", type=float, help=f"share of conversations kept ({d.sample:g})")
    p.add_argument("--speedup", type=float, help=f"arrivals compressed by ({d.speedup:g})")
    p.add_argument("--max-blocks", type=int, help=f"prompt blocks kept ({d.max_blocks})")
    p.add_argument("--max-output", type=int, help=f"output tokens at most ({d.max_output})")
    p.add_argument("--tokens-per-block", type=int, help=f"tokens a block id becomes ({16})")
    p.add_argument("--seed", type=int, help="seed of the sampling and the tokens (0)")
    p.add_argument("--device-blocks", type=int, help=f"device blocks ({FULL.device_blocks})")
    p.add_argument("--host-mib", type=int, help=f"host tier MiB per engine ({FULL.host_mib})")
    p.add_argument("--fs-mib", type=int, help=f"fs tier MiB ({FULL.fs_mib})")
    p.add_argument(
        "--policies",
        help="comma-separated host-tier policies beside lru (default: every policy of "
        "kvtier.blockpool.policies.POLICIES other than lru and arc)",
    )
    p.add_argument(
        "--only",
        help="comma-separated row kinds: alone, host, fs, private, shared (default: all)",
    )
    p.add_argument(
        "--require-mooncake",
        action="store_true",
        help="fail, instead of skipping the shared-store rows, without Mooncake's client",
    )
    return p.parse_args(argv)


def build(opts: argparse.Namespace) -> tuple[Window, Setup]:
    window = SMOKE_WINDOW if opts.smoke else Window()
    setup = SMOKE if opts.smoke else FULL
    overrides = {
        "start_s": opts.start,
        "seconds": opts.seconds,
        "sample": opts.sample,
        "speedup": opts.speedup,
        "max_blocks": opts.max_blocks,
        "max_output": opts.max_output,
        "tokens_per_block": opts.tokens_per_block,
        "seed": opts.seed,
    }
    window = Window(**{**asdict(window), **{k: v for k, v in overrides.items() if v is not None}})
    sizes = {"device_blocks": opts.device_blocks, "host_mib": opts.host_mib, "fs_mib": opts.fs_mib}
    setup = Setup(**{**asdict(setup), **{k: v for k, v in sizes.items() if v is not None}})
    return window, setup


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    window, setup = build(opts)
    try:
        trace = load_trace(opts.trace)  # the trace kvtier-tiering-spec ships, by default
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trace_name = Path(opts.trace).name if opts.trace else DEFAULT_TRACE.name
    requests = window.select(trace)
    if not requests:
        print("error: the window holds no request", file=sys.stderr)
        return 2
    policies = opts.policies.split(",") if opts.policies else new_policies()
    policies = [p.strip() for p in policies if p.strip()]
    only = set(opts.only.split(",")) if opts.only else None

    from tqdm import tqdm

    from kvtier.testkit import make_tiny_llama
    from kvtier.testkit.model import read_spec

    model = make_tiny_llama(None, **setup.model)
    tokens = BlockTokens(window.tokens_per_block, read_spec(model).vocab, window.seed)
    prompts = [tokens.prompt(r.hash_ids) for r in requests]
    longest = max(len(p) for p in prompts) + window.max_output
    max_model_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    n_tokens = sum(len(p) for p in prompts)
    print(
        f"trace {trace_name}: {len(requests)} of {len(trace)} requests "
        f"({window.seconds:g} s from {window.start_s:g} s, {window.sample:g} of the "
        f"conversations), {n_tokens} prompt tokens, {reuse_share(requests):.1%} of prompt "
        f"blocks reusable; arrivals over {requests[-1].arrival_s:.1f} s "
        f"(x{window.speedup:g}); {setup.device_blocks} device blocks of {BLOCK_SIZE} "
        f"tokens, host tier {setup.host_mib} MiB, fs tier {setup.fs_mib} MiB"
    )
    notes: list[str] = []
    log_dir = Path(opts.json).parent if opts.json else Path(tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    outputs: dict[str, list[list[int]]] = {}
    failed = False
    with contextlib.ExitStack() as stack:
        fs_root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-trace-fs-"))
        want_store = only is None or bool({"shared"} & only)
        store: dict[str, Any] | None = None
        missing = mooncake_available() if want_store else None
        if want_store and missing is None:
            store = stack.enter_context(mooncake_store(setup.store_mib << 20, log_dir))
        elif want_store:
            if opts.require_mooncake:
                print(f"error: Mooncake's store client: {missing} ({MOONCAKE_HINT})")
                return 2
            notes.append(f"shared store rows skipped: no Mooncake client ({MOONCAKE_HINT})")
        rows = plan_rows(setup, policies, fs_root, store, notes, only)
        rows = [r for r in rows if store is not None or not r.needs_store]
        if store is None:
            rows = [r for r in rows if r.kind != "private"]
        with tqdm(total=len(rows) * len(requests), unit="req") as bar:
            for row in rows:
                bar.set_description(row.label)
                try:
                    figures, outs = run_row(
                        row, model, setup, max_model_len, requests, prompts, log_dir, bar
                    )
                except Exception as exc:
                    failed = True
                    notes.append(f"{row.label}: FAILED: {exc}"[:2000])
                    continue
                results.append(figures)
                outputs[row.label] = outs
    wall = time.perf_counter() - started
    reference = outputs.get("vLLM alone")
    base = next((r for r in results if r["kind"] == "alone"), None)
    for r in results:
        r["identical"] = None if reference is None else outputs[r["run"]] == reference
        r["vs_alone"] = (
            round(base["ttft_p50_s"] / r["ttft_p50_s"], 2) if base and r["ttft_p50_s"] else None
        )
    print()
    print(format_table(results))
    for note in notes:
        print(f"note: {note}")
    checked = goals(results, policies)
    print("\n== goals")
    for g in checked:
        value = "not measured" if g["value"] is None else g["value"]
        print(f"  {'met ' if g['met'] else 'MISS'}  {g['goal']}: {value} (target {g['target']})")
    print(f"\n{len(rows)} runs in {wall:.0f} s")
    if opts.json:
        out = {
            "trace": trace_name,
            "window": asdict(window),
            "setup": asdict(setup),
            "requests": len(requests),
            "prompt_tokens": n_tokens,
            "reusable_block_share": round(reuse_share(requests), 4),
            "rows": results,
            "goals": checked,
            "notes": notes,
            "wall_s": round(wall, 1),
        }
        Path(opts.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json}")
    differ = any(r["identical"] is False for r in results)
    return 1 if failed or differ else 0


if __name__ == "__main__":
    sys.exit(main())
