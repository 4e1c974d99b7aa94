"""End to end on vLLM's CPU platform with the tests' tiny model.

Sixteen prompts: two passes over eight 128-token prefixes, each with its own suffix.
A 12-block device cache cannot keep the prefixes between passes; the reference run
has room for everything. Greedy outputs must match it token by token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
import kvtier.testkit as testkit  # noqa: E402

pytest.importorskip("vllm")

from kvtier.testkit import Workload, compare_outputs, kv_transfer_config, run_with  # noqa: E402
from kvtier.testkit.engine import kv_connector_of  # noqa: E402
from kvtier.vllm_port import sync_loads  # noqa: E402

WORKLOAD = Workload(prefix_prompts(), 8)


@pytest.fixture(scope="module")
def model() -> Path:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return testkit.make_tiny_llama()


@pytest.fixture(scope="module", autouse=True)
def block_hash_seed() -> Any:
    """One block-hash seed for every engine of this module, as the README asks of engines
    that share an fs tier: older vLLM releases (0.23 among them) seed sha256 block hashes
    at random per engine unless PYTHONHASHSEED is set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED", "0"))
        yield


@pytest.fixture(scope="module")
def fs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fs-tier")


def inspect(llm: Any) -> dict[str, Any]:
    core = kv_connector_of(llm).connector_scheduler.manager.core
    return {
        "counters": core.counters,
        "fs": [(t.stats, t.faults()) for t in core.secondary_tiers],
    }


_runs: dict[str, Any] = {}


def run(name: str, model: Path, **engine: Any) -> tuple[Any, Any]:
    if name not in _runs:
        _runs[name] = run_with(
            model, WORKLOAD, inspect=inspect if "kv_transfer_config" in engine else None, **engine
        )
    return _runs[name]


def reference(model: Path) -> Any:
    return run("reference", model, **ROOMY)[0]


def no_offload(model: Path) -> Any:
    return run("no-offload", model, **ENGINE)[0]


def tiering(model: Path, fs_root: Path, name: str = "fs-first") -> tuple[Any, Any]:
    cfg = offload_config("TieringOffloadingSpec", host_chunks=10, root_dir=str(fs_root))
    return run(name, model, kv_transfer_config=kv_transfer_config(cfg), **ENGINE)


def assert_identical(ref: Any, got: Any) -> None:
    cmp = compare_outputs(ref.outputs, got.outputs)
    assert cmp.identical, cmp.report()


def test_without_offload_the_device_cache_recomputes_the_prefixes(model: Path) -> None:
    ref, plain = reference(model), no_offload(model)
    assert_identical(ref, plain)
    assert plain.scheduled_tokens > ref.scheduled_tokens


def test_host_tier_hits_save_work_and_keep_outputs_identical(model: Path) -> None:
    cfg = offload_config("CPUOffloadingSpec", host_chunks=64)
    res, seen = run("host", model, kv_transfer_config=kv_transfer_config(cfg), **ENGINE)
    assert_identical(reference(model), res)
    assert res.metrics.get("vllm:external_prefix_cache_hits", 0) > 0, res.metrics
    assert res.metrics.get("vllm:kvtier_host_hits", 0) > 0
    assert seen["counters"].host_hits > 0
    assert res.scheduled_tokens < no_offload(model).scheduled_tokens, (
        res.scheduled_tokens,
        no_offload(model).scheduled_tokens,
    )


def test_fs_tier_serves_what_the_small_host_tier_evicted(model: Path, fs_root: Path) -> None:
    res, seen = tiering(model, fs_root)
    assert_identical(reference(model), res)
    stats, faults = seen["fs"][0]
    assert stats.writes > 0 and stats.reads > 0, stats
    assert seen["counters"].promotions > 0
    assert not any(faults.values()), faults
    assert res.metrics.get("vllm:kv_offload_tiering_read_bytes", 0) > 0
    assert res.scheduled_tokens < no_offload(model).scheduled_tokens


def test_a_second_engine_on_the_same_root_dir_hits_the_first_runs_files(
    model: Path, fs_root: Path
) -> None:
    first, _ = tiering(model, fs_root)  # the first engine wrote the files
    res, seen = tiering(model, fs_root, name="fs-second")
    assert_identical(reference(model), res)
    stats, faults = seen["fs"][0]
    assert stats.files_indexed_at_start > 0
    assert stats.reads > 0 and seen["counters"].promotions > 0
    assert not any(faults.values()), faults
    # Its first pass over the prefixes is served from the first engine's files.
    assert res.scheduled_tokens < first.scheduled_tokens, (
        res.scheduled_tokens,
        first.scheduled_tokens,
    )


def test_requests_that_ask_for_the_host_tier_only_never_load_from_the_fs_tier(
    model: Path, fs_root: Path
) -> None:
    """vLLM 0.32's per-request ``kv_load_tiers`` (in ``kv_transfer_params``): requests
    that name the host tier (medium CPU) alone find the first engine's files on the fs
    tier and do not read them, ahead of their turn or in their lookup; the host tier
    still serves their second pass. Outputs stay the reference's."""
    from vllm import SamplingParams

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            KV_LOAD_TIERS_KEY,
        )
    except ImportError:
        pytest.skip("this vLLM has no per-request kv_load_tiers")
    tiering(model, fs_root)  # the first engine wrote the files
    params = SamplingParams(
        temperature=0.0,
        ignore_eos=True,
        max_tokens=WORKLOAD.max_tokens,
        extra_args={"kv_transfer_params": {KV_LOAD_TIERS_KEY: [{"medium": "CPU"}]}},
    )
    cfg = offload_config("TieringOffloadingSpec", host_chunks=10, root_dir=str(fs_root))
    with testkit.llm_session(model, kv_transfer_config=kv_transfer_config(cfg), **ENGINE) as llm:
        prompts = [{"prompt_token_ids": list(p)} for p in WORKLOAD.prompts]
        results = llm.generate(prompts, params, use_tqdm=False)
        seen = inspect(llm)
        hits = testkit.metric_values(list(llm.get_metrics()))
    outputs = [list(r.outputs[0].token_ids) for r in results]
    cmp = compare_outputs(reference(model).outputs, outputs)
    assert cmp.identical, cmp.report()
    stats, faults = seen["fs"][0]
    assert stats.files_indexed_at_start > 0, "the first engine's files are there"
    assert stats.reads == 0 and seen["counters"].promotions == 0, stats
    assert seen["counters"].promoted_ahead == 0
    assert seen["counters"].host_hits > 0, "the host tier serves them"
    assert hits.get("vllm:external_prefix_cache_hits", 0) > 0, hits
    assert not any(faults.values()), faults


def test_files_corrupted_between_runs_are_counted_and_never_loaded(
    model: Path, fs_root: Path
) -> None:
    tiering(model, fs_root)
    files = list(fs_root.rglob("*.kv"))
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(4096 + 1000)
            byte = fh.read(1)
            fh.seek(4096 + 1000)
            fh.write(bytes([byte[0] ^ 0x5A]))
    res, seen = tiering(model, fs_root, name="fs-corrupt")
    assert_identical(reference(model), res)
    _, faults = seen["fs"][0]
    assert faults["corrupt"] > 0, faults
    assert res.metrics.get("vllm:kvtier_fs_faults", 0) > 0


@pytest.mark.parametrize("spec_name", ["CPUOffloadingSpec", "TieringOffloadingSpec"])
def test_the_guides_examples_start_and_serve(model: Path, tmp_path: Path, spec_name: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {
        # The guide reserves 8 GiB; this shared test machine gets 256 MiB.
        "cpu_bytes_to_use": 256 * (1 << 20),
        "blocks_per_chunk": 8,
        "spec_name": spec_name,
    }
    if spec_name == "TieringOffloadingSpec":
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(tmp_path / "vllm_kv_offload")}]
    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    # gpu_memory_utilization is the guide's 0.5 on an NPU; on vLLM's CPU platform it is
    # the share of host memory, so a shared test machine uses less.
    llm = LLM(model=str(model), gpu_memory_utilization=0.15, kv_transfer_config=kv_transfer_config)
    try:
        sampling_params = SamplingParams(max_tokens=100, temperature=0.0)
        outputs = llm.generate(["Hello, my name is"], sampling_params)
        assert len(outputs[0].outputs[0].token_ids) == 100
        manager = kv_connector_of(llm).connector_scheduler.manager
        from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager

        assert isinstance(manager, KvtierOffloadingManager), type(manager)
    finally:
        testkit.free_llm(llm)


def test_a_waiting_requests_prefix_comes_up_from_the_fs_tier_before_its_turn(
    model: Path, tmp_path: Path
) -> None:
    """The second pass's prefixes are in the fs tier only (the 10-chunk host tier keeps
    the last two or three), and each request waits in vLLM's queue behind two running
    ones. Promoted while it waits, its prefix is a host hit when vLLM first looks it up:
    no lookup reads "not known yet", which would make vLLM skip the request and give its
    seat to the next one (it then waited for a running request to finish). That holds
    where restores run inside the step (vLLM 0.32 on)."""
    cfg = offload_config("TieringOffloadingSpec", host_chunks=10, root_dir=str(tmp_path))
    first_answers: dict[str, int | None] = {}
    with testkit.llm_session(model, kv_transfer_config=kv_transfer_config(cfg), **ENGINE) as llm:
        scheduler = kv_connector_of(llm).connector_scheduler
        ask = scheduler.get_num_new_matched_tokens

        def first_answer(request: Any, *args: Any, **kwargs: Any) -> Any:
            answer = ask(request, *args, **kwargs)
            first_answers.setdefault(request.request_id, answer[0])
            return answer

        scheduler.get_num_new_matched_tokens = first_answer
        res = testkit.run_workload(llm, WORKLOAD)
        counters = scheduler.manager.core.counters
        in_step = sync_loads.native(scheduler) or hasattr(scheduler, "_kvtier_sync_loads")
    assert_identical(reference(model), res)
    assert counters.promoted_ahead > 0, counters
    if in_step:
        # (vLLM 0.23 restores between steps, each holding its promoted blocks until its
        # load ends, so requests there also wait for the promotions' room.)
        waited = [req for req, hit in first_answers.items() if hit is None]
        assert not waited, (waited, counters)


def test_the_traffic_it_serves_is_recorded_as_a_trace(model: Path, tmp_path: Path) -> None:
    """``record_traffic_dir``: every request of the run, in arrival order, with its
    lengths and one id per 32-token chunk; a prefix asked twice has the same ids."""
    from kvtier.tiering_spec.tracefile import load_trace_file

    folder = tmp_path / "traffic"
    cfg = offload_config("CPUOffloadingSpec", host_chunks=64)
    cfg["kv_connector_extra_config"]["record_traffic_dir"] = str(folder)
    res, _ = run_with(model, WORKLOAD, kv_transfer_config=kv_transfer_config(cfg), **ENGINE)
    assert_identical(reference(model), res)
    (path,) = folder.glob("traffic-*.jsonl")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    trace = load_trace_file(path)
    assert trace.header is not None and trace.header["tokens_per_id"] == 32
    assert trace.header["bytes_per_id"] == 65536
    shape = trace.header["model_shape"]
    assert (shape["layers"], shape["kv_heads"], shape["head_dim"]) == (2, 2, 64)
    assert trace.end == {"requests": len(WORKLOAD.prompts), "dropped": 0}, "closed at shutdown"
    prompts = WORKLOAD.prompts
    assert [r.input_length for r in trace.requests] == [len(p) for p in prompts]
    assert all(r.output_length == WORKLOAD.max_tokens for r in trace.requests)
    assert [len(r.hash_ids) for r in trace.requests] == [len(p) // 32 for p in prompts]
    by_prefix: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for prompt, req in zip(prompts, trace.requests):
        by_prefix.setdefault(tuple(prompt[:128]), set()).add(req.hash_ids[:4])
    assert all(len(ids) == 1 for ids in by_prefix.values()), "a prefix keeps its ids"
    heads = [next(iter(ids)) for ids in by_prefix.values()]
    assert len({i for ids in heads for i in ids}) == 4 * len(heads), "prefixes share none"
