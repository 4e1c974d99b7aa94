"""What a KV connector reads of the objects vLLM hands it, where vLLM's releases differ.

vLLM passes a connector its configuration, each step's scheduler output, its requests,
the workers' output and its device block pool; some of their fields came (or went) with
a release. Each such read is a named function here, so a plugin never probes vLLM's
objects itself: a field a release lacks reads as what the function documents (the
answer of a release without it), and vLLM is never imported. The recompute connector
(``kvtier.recompute_connector``) reads vLLM's objects through these.
"""

from __future__ import annotations

import dis
from typing import Any

RECOMPUTE = "recompute"


def kv_load_failure_policy(vllm_config: Any) -> str | None:
    """The ``kv_transfer_config``'s ``kv_load_failure_policy`` (what vLLM does with a
    request whose KV load failed: ``"recompute"`` or ``"fail"``); None where there is no
    transfer configuration or the release has no such key."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return None if ktc is None else getattr(ktc, "kv_load_failure_policy", None)


def recompute_failed_loads(vllm_config: Any) -> bool:
    """Set ``kv_load_failure_policy`` to ``"recompute"`` on ``vllm_config``'s transfer
    configuration where it has one and its policy is anything else (the key is set
    on releases without it too, where it changes nothing); whether it was changed."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or kv_load_failure_policy(vllm_config) == RECOMPUTE:
        return False
    ktc.kv_load_failure_policy = RECOMPUTE
    return True


def additional_config(vllm_config: Any) -> Any:
    """The engine's ``additional_config`` (platform plugins' settings, such as
    vllm-ascend's), or None where the release has none."""
    return getattr(vllm_config, "additional_config", None)


def resumed_req_ids(cached_reqs: Any) -> set[str]:
    """The requests of a scheduler output's ``scheduled_cached_reqs`` that resume after
    a preemption this step (``resumed_req_ids``); empty where the release does not
    name them."""
    return getattr(cached_reqs, "resumed_req_ids", None) or set()


def block_hashes(request: Any) -> list[Any]:
    """A request's prefix-cache block hashes (``block_hashes``, one per hash-sized piece
    of its full blocks, chained); empty where the request carries none."""
    return list(getattr(request, "block_hashes", ()) or ())


def chunk_hashes(request: Any, per_chunk: int) -> list[Any]:
    """The block hash that names each complete chunk of ``per_chunk`` hash-sized pieces
    of a request's prompt, with its whole prefix (the chunk's last piece), in order;
    empty where the request carries no hashes."""
    hashes = getattr(request, "block_hashes", None) or ()
    return list(hashes[per_chunk - 1 :: per_chunk])


def worker_meta(connector_output: Any) -> Any:
    """The workers' connector metadata in a ``KVConnectorOutput``, aggregated over the
    ranks (``kv_connector_worker_meta``); None where the release has no such field."""
    return getattr(connector_output, "kv_connector_worker_meta", None)


def num_gpu_blocks(block_pool: Any) -> int | None:
    """The device blocks of vLLM's block pool (``num_gpu_blocks``, vLLM's null block
    included); None where the pool does not say."""
    count = getattr(block_pool, "num_gpu_blocks", None)
    return None if count is None else int(count)


_IDLE_OPS = {"RESUME", "NOP", "LOAD_CONST", "RETURN_VALUE", "RETURN_CONST", "CACHE"}


def _does_nothing(fn: Any) -> bool:
    """Whether ``fn`` is a plain function whose body returns None and does nothing else
    (``pass``, a docstring, a bare ``return``)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    return all(
        ins.opname in _IDLE_OPS
        and (ins.opname not in ("LOAD_CONST", "RETURN_CONST") or ins.argval is None)
        for ins in dis.get_instructions(code)
    )


def layer_hooks_idle(cls: type) -> bool:
    """Whether ``cls``'s per-layer hooks (``wait_for_layer_load``, ``save_kv_layer``)
    do nothing: plain functions whose body is ``pass`` (or a bare ``return``), as vLLM's
    ``OffloadingConnector`` has them on 0.23 to 0.33. vLLM calls both around every
    attention layer of every step unless ``has_connector_metadata()`` answers False
    (its only use in vLLM), so a connector whose hooks are idle may answer False."""
    return all(
        _does_nothing(getattr(cls, name, None)) for name in ("wait_for_layer_load", "save_kv_layer")
    )


def reads_argument(fn: Any, name: str) -> bool:
    """Whether the plain function ``fn`` reads its argument ``name``: any instruction of
    its body that names it, other than storing it, counts, as does a nested function
    that uses it or a call of ``locals``; True where ``fn`` has no such argument or is
    no plain function (it cannot tell). vLLM 0.32's offloading worker takes the
    requests that finished in a step in ``get_finished`` and never reads them."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return True
    args = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    if name not in args or name in code.co_cellvars or "locals" in code.co_names:
        return True
    for ins in dis.get_instructions(code):
        if ins.opname == "STORE_FAST":
            continue
        value = ins.argval
        if value == name or (isinstance(value, tuple) and name in value):
            return True
    return False


__all__ = [
    "additional_config",
    "block_hashes",
    "kv_load_failure_policy",
    "layer_hooks_idle",
    "num_gpu_blocks",
    "reads_argument",
    "recompute_failed_loads",
    "resumed_req_ids",
    "worker_meta",
]
