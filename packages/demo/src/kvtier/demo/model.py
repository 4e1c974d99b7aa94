"""Which model the demo runs, and the sizes that follow from it.

The workloads are defined in device KV blocks and tokens; the model decides how
many bytes a block holds, so host budgets are scaled to the model, and prompt
token ids are drawn from its vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvtier.vllm_port.facts import config_int, kv_shape, text_config

BLOCK_TOKENS = 32  # vLLM's CPU platform needs block sizes that are multiples of 32
DTYPE_BYTES = 4  # the demo runs float32: vLLM's CPU platform's safest choice


class ModelError(ValueError):
    """The model folder given to ``--model`` cannot be used."""


@dataclass(frozen=True)
class ModelSizes:
    """What the demo needs to know about a model.

    Attributes:
        path: the model folder.
        layers: decoder layers with a KV cache.
        kv_heads: key/value heads per layer.
        head_dim: elements per head.
        vocab: vocabulary size in tokens.
        max_positions: longest sequence the model supports, in tokens.
        special_ids: token ids not to put in prompts (BOS, EOS, pad, ...).
    """

    path: Path
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    special_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token across all layers (float32)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one device KV block of ``BLOCK_TOKENS`` tokens."""
        return self.kv_bytes_per_token * BLOCK_TOKENS


def read_model(path: str | Path) -> ModelSizes:
    """Read a Hugging Face model folder's ``config.json``; ``ModelError`` says what is wrong."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelError(f"--model {path}: not a directory (give a local model folder)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelError(f"--model {path}: no config.json in it; is it a Hugging Face model?")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"--model {path}: config.json cannot be read: {exc}") from exc
    cfg = text_config(cfg)
    layers, kv_heads, head_dim = kv_shape(cfg)
    vocab = config_int(cfg, "vocab_size")
    if not (layers and kv_heads and head_dim and vocab):
        raise ModelError(
            f"--model {path}: config.json lacks num_hidden_layers, num_attention_heads, "
            "hidden_size or vocab_size"
        )
    max_positions = config_int(cfg, "max_position_embeddings", "n_positions") or 2048
    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = cfg.get(key)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int):
                special.add(v)
    return ModelSizes(
        path=folder,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        max_positions=max_positions,
        special_ids=tuple(sorted(special | {0, 1, 2})),
    )


def demo_model(path: str | None) -> ModelSizes:
    """The user's model, or the tiny random-weight model made (once) on this machine."""
    if path is not None:
        return read_model(path)
    from kvtier.testkit import make_tiny_llama

    return read_model(make_tiny_llama())
