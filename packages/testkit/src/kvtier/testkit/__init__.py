"""kvtier-testkit: shared test helpers for kvtier's vLLM plugins.

* :func:`make_tiny_llama`: a tiny random-weight model and tokenizer, made offline, cached
  (:func:`make_tiny_mla`: one with multi-head latent attention; :func:`make_tiny_hybrid`:
  linear and full attention);
* :func:`run_workload`, :func:`compare_outputs`: greedy runs compared token by token;
* :class:`SchedulerTokenCounter`: the engine's work in scheduled tokens;
* :func:`run_script`, :func:`script_env`: a test package's script in a subprocess;
* ``kvtier.testkit.offloading.offloading_config``: vLLM's ``OffloadingConfig`` without an
  engine;
* ``kvtier.testkit.faults``: copies that fail and restores that are corrupted, injected
  from outside kvtier's code;
* ``kvtier.testkit.pytest_plugin``: session fixtures (``pytest_plugins = [...]``).

Importing it never imports vLLM; the engine helpers import it when called.
"""

from kvtier.testkit.__about__ import __version__
from kvtier.testkit.engine import (
    FORCED_PREEMPTION_ENGINE,
    FORCED_PREEMPTION_WORKLOAD,
    HYBRID_ENGINE,
    HYBRID_REFERENCE_ENGINE,
    HYBRID_WORKLOAD,
    PREFIX_ENGINE,
    PREFIX_REFERENCE_ENGINE,
    PREFIX_WORKLOAD,
    REFERENCE_ENGINE,
    SLIDING_WINDOW_ENGINE,
    SLIDING_WINDOW_WORKLOAD,
    Mismatch,
    OutputComparison,
    SchedulerTokenCounter,
    Workload,
    WorkloadResult,
    compare_outputs,
    engine_core,
    free_llm,
    greedy_params,
    in_process_engines,
    kv_connector_of,
    kv_transfer_config,
    labelled_metric_values,
    llm_session,
    make_llm,
    make_prefix_workload,
    make_workload,
    metric_values,
    run_with,
    run_workload,
    scheduler_of,
)
from kvtier.testkit.model import (
    ENV_MODEL_DIR,
    TinyModelSpec,
    default_model_root,
    make_tiny_hybrid,
    make_tiny_llama,
    make_tiny_mla,
    read_spec,
    special_token_ids,
)
from kvtier.testkit.scripts import run_python, run_script, script_env, tests_root

__all__ = [
    "ENV_MODEL_DIR",
    "FORCED_PREEMPTION_ENGINE",
    "FORCED_PREEMPTION_WORKLOAD",
    "HYBRID_ENGINE",
    "HYBRID_REFERENCE_ENGINE",
    "HYBRID_WORKLOAD",
    "PREFIX_ENGINE",
    "PREFIX_REFERENCE_ENGINE",
    "PREFIX_WORKLOAD",
    "REFERENCE_ENGINE",
    "SLIDING_WINDOW_ENGINE",
    "SLIDING_WINDOW_WORKLOAD",
    "Mismatch",
    "OutputComparison",
    "SchedulerTokenCounter",
    "TinyModelSpec",
    "Workload",
    "WorkloadResult",
    "__version__",
    "compare_outputs",
    "default_model_root",
    "engine_core",
    "free_llm",
    "greedy_params",
    "in_process_engines",
    "kv_connector_of",
    "kv_transfer_config",
    "labelled_metric_values",
    "llm_session",
    "make_llm",
    "make_prefix_workload",
    "make_tiny_hybrid",
    "make_tiny_llama",
    "make_tiny_mla",
    "make_workload",
    "metric_values",
    "read_spec",
    "requires_vllm",
    "run_python",
    "run_script",
    "run_with",
    "run_workload",
    "scheduler_of",
    "script_env",
    "special_token_ids",
    "tests_root",
    "vllm_available",
]


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _requires_vllm() -> object:
    import pytest

    return pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed here")


def __getattr__(name: str) -> object:
    # ``requires_vllm`` is a pytest mark; built on first use so importing the kit needs no pytest.
    if name == "requires_vllm":
        return _requires_vllm()
    raise AttributeError(name)
