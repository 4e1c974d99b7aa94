"""kvtier-vllm-port: what kvtier's two vLLM plugins share about meeting vLLM.

:mod:`kvtier.vllm_port.plugins` holds the plugin convention: the supported vLLM range
read from a distribution's ``vllm`` extra, ``KVTIER_...`` switches, the one switch for
vLLM's upstream names (``KVTIER_UPSTREAM_NAMES``), and registration through vLLM's own
factory methods (a factory is never patched).
"""

from kvtier.vllm_port.__about__ import __version__

__all__ = ["__version__"]
