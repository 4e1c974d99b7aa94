"""One vLLM engine process of the store-tier end-to-end test (run by test_store_e2e).

Usage: python -m tiering_spec_tests.store_engine_script OUT_JSON MODE [CONFIG_JSON] [PAUSE_DIR]

MODE is ``reference`` (room for everything, no connector), ``host`` (the host tier
alone) or ``store`` (the host tier plus the store tier of CONFIG_JSON). The prefix
workload runs in two halves; with PAUSE_DIR the script writes ``PAUSE_DIR/half`` after
the first and waits for ``PAUSE_DIR/go`` before the second (the test kills the master
in between). OUT_JSON gets the outputs, the scheduled tokens, the store tier's hits
and faults, and the engine's metrics.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import kvtier.testkit as testkit
    from kvtier.testkit import Workload, kv_transfer_config
    from kvtier.testkit.engine import kv_connector_of

    from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

    out, mode = sys.argv[1], sys.argv[2]
    tier = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    pause = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    prompts = prefix_prompts()
    halves = [Workload(prompts[:8], 8), Workload(prompts[8:], 8)]
    engine: dict[str, Any] = dict(ROOMY)
    if mode != "reference":
        cfg = offload_config("TieringOffloadingSpec", host_chunks=10)
        if mode == "store":
            cfg["kv_connector_extra_config"]["secondary_tiers"] = [tier]
        engine = {**ENGINE, "kv_transfer_config": kv_transfer_config(cfg)}
    llm = testkit.make_llm(testkit.make_tiny_llama(), **engine)
    try:
        store = None
        if mode == "store":
            store = kv_connector_of(llm).connector_scheduler.manager.core.secondary_tiers[0]
            if not store.wait_connected(60):
                raise SystemExit("the store tier did not connect")
        outputs: list[list[int]] = []
        scheduled = 0
        for i, half in enumerate(halves):
            if i == 1 and pause is not None:
                (pause / "half").write_text("done")
                deadline = time.monotonic() + 120
                while not (pause / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            res = testkit.run_workload(llm, half)
            outputs += res.outputs
            scheduled += res.scheduled_tokens
        result: dict[str, Any] = {"outputs": outputs, "scheduled_tokens": scheduled}
        if store is not None:
            counters = kv_connector_of(llm).connector_scheduler.manager.core.counters
            result["counters"] = {k: v for k, v in vars(counters).items() if isinstance(v, int)}
            store.drain(30)
            store.poll()
            result["metrics"] = testkit.metric_values(list(llm.get_metrics()))
            result.update(
                objects=[store.object_keys(d)[0] for d in list(store._index)],
                hits=store.stats.hits,
                reads=store.stats.reads,
                writes=store.stats.writes,
                faults=store.faults(),
            )
        Path(out).write_text(json.dumps(result))
    finally:
        testkit.free_llm(llm)


if __name__ == "__main__":
    main()
