"""The one place where kvtier meets vLLM's interfaces: :class:`VllmPort`.

vLLM rewrote the interfaces kvtier implements between its 0.23 release (the one
vllm-ascend 0.23 runs on) and 0.26. kvtier supports two interface generations, one
implementation each, chosen once when a kvtier plugin registers (:func:`select`):

* :class:`OffloadingConfigPort`, vLLM 0.26 and later: a spec is built from an
  ``OffloadingConfig`` (``vllm.v1.kv_offload.config``), which names the engine's model
  by its path alone, so kvtier's connector runs vLLM's connector constructor's steps
  itself and builds its spec with the engine's facts as an argument
  (:meth:`VllmPort.init_offloading_connector`). Its worker is an ``OffloadingWorker`` and
  its manager answers lookups with a ``LookupResult``.
* :class:`LegacyPort`, vLLM 0.23 to 0.25: a spec is built from ``(vllm_config,
  kv_cache_config)`` and reads the facts from them; vLLM drives a spec's transfers
  through handlers (before 0.25), a lookup answers ``True`` / ``None`` / ``False``
  (before 0.25) and an event's medium is a string.

What changed inside a generation (an event's ``Medium`` and fields, vLLM 0.32's
``bind_kv_cache_manager`` and request-level load failures, its fixed block-hash seed,
its per-request state, its KV tensor placements) is probed here too, from vLLM's own
classes and never from its version number, and kept for the process. No other module
of kvtier asks which vLLM it runs on; both plugins ask the port.

The port also reads the engine once: :meth:`VllmPort.engine_facts` turns vLLM's configs
into :class:`~kvtier.vllm_port.facts.EngineFacts`. And it is the only reader of vLLM's
private state (:meth:`VllmPort.load_job_requests`, :meth:`VllmPort.store_job_keys`).

The interface is :mod:`kvtier.vllm_port.interface`, each generation a module of its
own (:mod:`~kvtier.vllm_port.gen_offloading`, :mod:`~kvtier.vllm_port.gen_legacy`);
this module chooses one. vLLM is imported only when a method is called, so these
modules import without it.
"""

from __future__ import annotations

import logging

from kvtier.vllm_port.gen_legacy import LegacyPort
from kvtier.vllm_port.gen_offloading import OffloadingConfigPort
from kvtier.vllm_port.interface import VllmPort

__all__ = ["GENERATIONS", "LegacyPort", "OffloadingConfigPort", "VllmPort", "current", "select"]

logger = logging.getLogger("kvtier.vllm_port")


# Newest first: the first generation whose interfaces the installed vLLM has serves it.
GENERATIONS: tuple[type[VllmPort], ...] = (OffloadingConfigPort, LegacyPort)

_selected: list[VllmPort] = []


def select() -> VllmPort:
    """Choose the port for the installed vLLM (once per process; a kvtier plugin does
    it when it registers) and return it."""
    if not _selected:
        for generation in GENERATIONS:
            if generation.serves():
                _selected.append(generation())
                logger.debug(
                    "kvtier: vLLM's interfaces of %s (%s)",
                    generation.releases,
                    generation.generation,
                )
                break
        else:
            raise RuntimeError(
                "kvtier: no vLLM with an offloading interface kvtier supports is installed "
                "(vllm.v1.kv_offload is missing; kvtier supports vLLM 0.23 and later)"
            )
    return _selected[0]


def current() -> VllmPort:
    """The port chosen for this process (chosen now if no plugin registered)."""
    return _selected[0] if _selected else select()
