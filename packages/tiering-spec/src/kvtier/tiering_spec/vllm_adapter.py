"""kvtier's offloading specs for vLLM: vLLM's shapes over :mod:`kvtier.tiering_spec.build`.

The module name is the one configurations give as ``spec_module_path``.

``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` implement vLLM 0.32's
``OffloadingSpec``. Each turns what vLLM hands it (an ``OffloadingConfig``, or before
0.26 the engine's configs through :mod:`.vllm_compat`) into kvtier's
:class:`~kvtier.tiering_spec.offload_facts.OffloadFacts`, validates
``kv_connector_extra_config``, and calls :func:`~kvtier.tiering_spec.build.build` once:
sizing, regions, fingerprint, pool, tiers and worker are built there, without vLLM.
Their manager is :class:`~kvtier.tiering_spec.vllm_manager.KvtierOffloadingManager`
over the built scheduler side, their worker
:class:`~kvtier.tiering_spec.vllm_worker.KvtierOffloadingWorker` over the built worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
)

from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec import vllm_compat as compat
from kvtier.tiering_spec.build import Offload, build
from kvtier.tiering_spec.config import OffloadConfig, parse_config
from kvtier.tiering_spec.offload_facts import GroupFacts, OffloadFacts
from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager
from kvtier.tiering_spec.vllm_worker import KvtierOffloadingWorker
from kvtier.vllm_port.facts import EngineFacts


def offload_facts(spec: Any, engine: EngineFacts | None) -> OffloadFacts:
    """kvtier's facts from what vLLM's spec holds: its ``OffloadingConfig`` (or the one
    :mod:`.vllm_legacy_spec` derives), its chunking and its KV events config."""
    config = spec.config
    parallel = config.parallel
    model = config.model
    return OffloadFacts(
        engine_id=str(config.engine_id),
        model_name=model.name,
        cache_dtype=model.dtype,
        groups=tuple(
            GroupFacts(
                int(g.group_id),
                tuple(g.layer_names),
                int(g.tokens_per_block),
                getattr(g, "sliding_window_size_in_chunks", None),  # vLLM 0.33
            )
            for g in config.groups
        ),
        blocks_per_chunk=int(spec.blocks_per_chunk),
        tokens_per_hash=int(spec.tokens_per_hash),
        worker_kv_bytes_per_block=int(config.worker_kv_bytes_per_block),
        rank=int(parallel.rank),
        world_size=int(parallel.world_size),
        tp_size=parallel.tp_size,
        pp_size=parallel.pp_size,
        pcp_size=parallel.pcp_size,
        dcp_size=parallel.dcp_size,
        max_model_len=int(getattr(model, "max_model_len", 0) or 0),  # vLLM 0.33
        kv_cache_layout=config.kv_cache_layout,
        replicated_layout=bool(getattr(config, "replicated_layout", False)),
        kv_events=bool(spec.kv_events_config.enable_kv_cache_events),
        engine=engine,
    )


def _stand_in_for_vllms_cpu_spec() -> None:
    """Make kvtier's specs count as vLLM's ``CPUOffloadingSpec`` where vLLM asks.

    vLLM 0.32's connector metrics keep its deprecated transfer metrics
    (``vllm:kv_offload_total_bytes``, ``vllm:kv_offload_total_time``,
    ``vllm:kv_offload_size``) only for a spec class that subclasses its
    ``CPUOffloadingSpec`` (as its ``TieringOffloadingSpec`` does), and ask right
    after the spec's ``build_metric_definitions``. kvtier's specs answer that name, so
    they are registered as its virtual subclasses (``ABC.register``): ``issubclass``
    and ``isinstance`` say yes, and nothing of vLLM's class is inherited. Idempotent; a
    release without that class, or where it is no ABC, is left alone.
    """
    vllm_cpu_spec: Any = compat.PORT.vllm_cpu_spec()
    if vllm_cpu_spec is None:
        return
    for spec in (CPUOffloadingSpec, TieringOffloadingSpec):
        if not issubclass(spec, vllm_cpu_spec):
            vllm_cpu_spec.register(spec)


# vLLM 0.33's labels of the host tier's sizing (CPUOffloadingInfo).
CONFIG_INFO_KEYS = (
    "cpu_num_chunks",
    "cpu_blocks_per_chunk",
    "cpu_kv_cache_size_bytes",
    "cpu_kv_cache_size_tokens",
)


class _KvtierSpec(OffloadingSpec):
    """What both specs share: the mapping of vLLM's spec onto kvtier's build.

    vLLM builds a spec from an ``OffloadingConfig`` (vLLM 0.32) or from its
    ``(vllm_config, kv_cache_config)`` (older releases); :func:`.vllm_compat.init_spec`
    makes both look like the first.
    """

    TIERING = False
    extra_config: dict[str, Any]  # vLLM's spec sets it: kv_connector_extra_config

    # Set by kvtier's connector, which reports failed transfers to vLLM's scheduler
    # as blocks to recompute instead of failing vLLM's assertion.
    failures_reported = False

    @classmethod
    def kvtier_metric_table(cls, extra_config: Mapping[str, Any]) -> dict[str, m.MetricRow]:
        return m.metric_table(extra_config, tiering=cls.TIERING)

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The labels of vLLM's (0.33) ``vllm:kv_offload_config_info`` that the manager's
        ``config_info`` fills: the host tier's sizing, as vLLM's CPU spec names it, and
        with secondary tiers the tier's label."""
        return CONFIG_INFO_KEYS + ((m.TIER_LABEL,) if cls.TIERING else ())

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        # vLLM's metrics ask next whether this class is its CPUOffloadingSpec.
        _stand_in_for_vllms_cpu_spec()
        return compat.metric_definitions(cls.kvtier_metric_table(extra_config))

    def __init__(self, *args: Any, engine_facts: EngineFacts | None = None) -> None:
        compat.init_spec(self, *args)
        extra: dict[str, Any] = self.extra_config
        self.settings: OffloadConfig = parse_config(extra, tiering=self.TIERING)
        # vLLM 0.33's scheduler reads its budget of synchronous loads from here (0 when
        # unset); kvtier's default applies there too. On 0.32 kvtier's connector does it.
        if "sync_load_budget_bytes" not in extra:
            sync_budget = self.settings.sync_load_budget_bytes
            self.extra_config = {**extra, "sync_load_budget_bytes": sync_budget}
        # What identifies the model and the KV layout (only the fs tier's fingerprint needs
        # all of it): kvtier's connector hands it over (vLLM 0.26 and later hand a spec
        # only an OffloadingConfig); older releases hand the spec the configs themselves.
        engine = engine_facts if engine_facts is not None else compat.engine_facts(self)
        facts = offload_facts(self, engine)
        self.offload: Offload = build(
            facts, self.settings, tiering=self.TIERING, name=type(self).__name__
        )
        # What vLLM (and tools written for its specs) read of a spec, from the build;
        # the rest is the offload's (self.offload).
        sizing = self.offload.sizing
        self.replicated_layout = sizing.replicated_layout
        self.num_copies = sizing.num_copies
        self.chunk_bytes = sizing.chunk_bytes
        self.kv_bytes_per_chunk = sizing.kv_bytes_per_chunk
        self.cpu_page_size_per_worker = sizing.cpu_page_size_per_worker
        self.num_chunks = sizing.num_chunks
        self.budget_description = sizing.budget_description
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def config_info_row(self) -> dict[str, Any]:
        """The host tier's sizing as vLLM's CPU tier publishes it (see
        :meth:`kvtier.tiering_spec.build.Offload.config_info_row`)."""
        return self.offload.config_info_row()

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self.offload.scheduler())
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        if self._worker is None:
            compat.stand_in_for_vllms_worker(KvtierOffloadingWorker)
            side = self.offload.worker([t.tensor for t in kv_caches.tensors])
            self._worker = KvtierOffloadingWorker(side.core, store=side.store)
            self._worker.failures_reported = self.failures_reported
        return self._worker

    def get_handlers(self, kv_caches: Any) -> Any:
        """vLLM before 0.25: the transfer handlers, over :meth:`get_worker`'s worker."""
        return compat.transfer_handlers(self.get_worker(kv_caches))


class CPUOffloadingSpec(_KvtierSpec):
    """kvtier's host-tier spec: host DRAM behind the device KV cache."""

    TIERING = False


class TieringOffloadingSpec(_KvtierSpec):
    """kvtier's multi-tier spec: the host tier plus secondary tiers (``fs``, ``mooncake``).

    The host region is shared (``/dev/shm``) so the scheduler's secondary tiers read and
    write the bytes that the workers copy to and from the device.
    """

    TIERING = True


# Names under which kvtier's classes are reachable with spec_module_path
# "kvtier.tiering_spec.vllm_adapter" or "kvtier.tiering_spec" whatever the registry holds.
KvtierCPUOffloadingSpec = CPUOffloadingSpec
KvtierTieringOffloadingSpec = TieringOffloadingSpec
