"""A tiny random-weight causal LM and tokenizer, made offline, for engine tests.

No model can be downloaded where kvtier's tests run, so the tests make their own:
a Llama (or, with a sliding window, a Mistral; or a DeepSeek-V2 with multi-head latent
attention; or a Qwen3-Next, a hybrid of linear and full attention) of a few layers with
random weights,
saved with transformers, and a byte-level BPE tokenizer trained with ``tokenizers``
on generated text. The EOS logit row is zeroed so greedy runs reach ``max_tokens``.

Models are cached: one folder per parameter set under :func:`default_model_root`,
written to a temporary folder first and renamed into place, so concurrent test
processes never see a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV_MODEL_DIR = "KVTIER_TINY_MODEL_DIR"
# A tiny MLA model's KV row: latent and rotary widths, in elements.
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
MARKER = "kvtier-tiny-model.json"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# Bump when the recipe changes, so stale cached models are not reused.
RECIPE_VERSION = 1


@dataclass(frozen=True)
class TinyModelSpec:
    """What :func:`make_tiny_llama` builds. Sizes are in elements (not bytes).

    Attributes:
        layers: decoder layers.
        hidden: hidden size.
        heads: attention heads (and KV heads: no grouped-query attention).
        head_dim: elements per head; vLLM's CPU attention accepts 32, 64, 80, 96, 112, 128.
        vocab: vocabulary size in tokens, specials included.
        seed: seed for weights and tokenizer training text.
        sliding_window: attention window in tokens; ``None`` for full attention (Llama).
        kv_heads: KV heads (grouped-query attention); ``None`` for as many as ``heads``.
        mla: a DeepSeek-V2 with multi-head latent attention (``head_dim`` is then the
            per-head query/key and value width beside the latent; see :func:`make_tiny_mla`).
        hybrid: a Qwen3-Next whose layers alternate linear attention (Gated DeltaNet) and
            full attention (see :func:`make_tiny_hybrid`).
        positions: the longest sequence the model takes (``max_position_embeddings``).
    """

    layers: int = 2
    hidden: int = 128
    heads: int = 2
    head_dim: int = 64
    vocab: int = 512
    seed: int = 0
    sliding_window: int | None = None
    kv_heads: int | None = None
    mla: bool = False
    hybrid: bool = False
    positions: int = 1024

    @property
    def architecture(self) -> str:
        if self.mla:
            return "deepseek-v2"
        if self.hybrid:
            return "qwen3-next"
        return "mistral" if self.sliding_window else "llama"

    def folder_name(self) -> str:
        fields = asdict(self)
        if fields["kv_heads"] is None:
            del fields["kv_heads"]  # folders made before GQA keep their names
        if not fields["mla"]:
            del fields["mla"]  # and those made before MLA
        if not fields["hybrid"]:
            del fields["hybrid"]  # and those made before hybrid models
        if fields["positions"] == 1024:
            del fields["positions"]  # and those of the first length
        blob = json.dumps({"recipe": RECIPE_VERSION, **fields}, sort_keys=True)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
        sw = f"-sw{self.sliding_window}" if self.sliding_window else ""
        return f"tiny-{self.architecture}-l{self.layers}-h{self.hidden}{sw}-{digest}"


def default_model_root() -> Path:
    """Where tiny models are cached: ``$KVTIER_TINY_MODEL_DIR``, else
    ``$XDG_CACHE_HOME/kvtier/tiny-models`` (``~/.cache/kvtier/tiny-models``)."""
    env = os.environ.get(ENV_MODEL_DIR)
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache) / "kvtier" / "tiny-models"


def _training_text(seed: int, lines: int = 2000) -> list[str]:
    """Pseudo-words over a small alphabet: enough for BPE to learn a few hundred merges."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(600)]
    return [" ".join(rng.choices(words, k=rng.randint(4, 16))) for _ in range(lines)]


def _train_tokenizer(folder: Path, vocab: int, seed: int) -> dict[str, int]:
    """Train a byte-level BPE tokenizer of ``vocab`` tokens, save it as a fast tokenizer.

    Returns the ids of the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(folder))
    ids: dict[str, int] = {}
    for name in SPECIAL_TOKENS:
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise RuntimeError(f"trained tokenizer lacks the special token {name}")
        ids[name] = token_id
    return ids


def _build(folder: Path, spec: TinyModelSpec) -> None:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    ids = _train_tokenizer(folder, spec.vocab, spec.seed)
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads or spec.heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.positions,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<unk>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model: Any
    if spec.mla:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        dense = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}
        # The latent (512) plus the rotary part (64) make the 576-element KV row that
        # vLLM's CPU MLA kernel is built for. Every layer dense: no experts run.
        config = DeepseekV2Config(
            kv_lora_rank=MLA_KV_LORA_RANK,
            qk_rope_head_dim=MLA_ROPE_DIM,
            qk_nope_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            q_lora_rank=None,
            first_k_dense_replace=spec.layers,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=spec.hidden // 2,
            num_key_value_heads=spec.heads,
            **dense,
        )
        model = DeepseekV2ForCausalLM(config)
    elif spec.hybrid:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # Alternating layer kinds give one KV cache group of each. Linear-attention head
        # dims of 64: vLLM's CPU Gated DeltaNet kernel needs 64 or more (and bf16).
        hybrid_config = Qwen3NextConfig(
            layer_types=[
                "linear_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)
            ],
            linear_num_key_heads=spec.heads,
            linear_num_value_heads=spec.heads,
            linear_key_head_dim=spec.head_dim,
            linear_value_head_dim=spec.head_dim,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=spec.hidden // 2,
            shared_expert_intermediate_size=spec.hidden // 2,
            **common,
        )
        model = Qwen3NextForCausalLM(hybrid_config)
    elif spec.sliding_window:
        model = MistralForCausalLM(MistralConfig(sliding_window=spec.sliding_window, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        # A zero row gives EOS the logit 0, below the max of hundreds of random logits.
        model.lm_head.weight[ids["</s>"]].zero_()
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)


def _check_sizes(layers: int, heads: int, head_dim: int, vocab: int) -> None:
    if vocab < 300:
        raise ValueError(
            f"vocab must be at least 300 tokens (byte alphabet + specials), got {vocab}"
        )
    if heads * head_dim <= 0 or layers <= 0:
        raise ValueError("layers, heads and head_dim must be positive")


def make_tiny_llama(
    path: str | os.PathLike[str] | None = None,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    head_dim: int = 64,
    vocab: int = 512,
    seed: int = 0,
    sliding_window: int | None = None,
    kv_heads: int | None = None,
    positions: int = 1024,
) -> Path:
    """Make (or reuse) a tiny random-weight model and return its folder.

    ``path`` is a cache root (default :func:`default_model_root`); the model lives in a
    sub-folder named after its parameters, so one root holds several variants. A
    folder already made with the same parameters is reused. The model is a Llama, or a
    Mistral with ``sliding_window`` (tokens) set, with ``kv_heads`` KV heads (default
    ``heads``; it must divide ``heads``). ``vocab`` is in tokens (at least 300:
    the byte-level alphabet plus specials); ``hidden`` and ``head_dim`` in elements;
    ``positions`` is the longest sequence in tokens.
    """
    _check_sizes(layers, heads, head_dim, vocab)
    if positions < 64:
        raise ValueError(f"positions must be at least 64 tokens, got {positions}")
    if kv_heads is not None and (kv_heads <= 0 or heads % kv_heads):
        raise ValueError(f"kv_heads must be a positive divisor of heads={heads}, got {kv_heads}")
    spec = TinyModelSpec(
        layers, hidden, heads, head_dim, vocab, seed, sliding_window, kv_heads, positions=positions
    )
    return _make(spec, path)


def make_tiny_mla(
    path: str | os.PathLike[str] | None = None,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    head_dim: int = 32,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    """Make (or reuse) a tiny random-weight DeepSeek-V2 (multi-head latent attention, no
    experts) and return its folder, cached as :func:`make_tiny_llama`'s models.

    Its KV is one row of 576 elements per token and layer (a 512-element latent plus 64
    rotary), shared by all heads, so vLLM reports it replicated across tensor-parallel
    ranks. ``head_dim`` is each head's query/key width beside the rotary part and its
    value width. vLLM's CPU platform runs it with ``block_size`` 16 only.
    """
    _check_sizes(layers, heads, head_dim, vocab)
    return _make(TinyModelSpec(layers, hidden, heads, head_dim, vocab, seed, mla=True), path)


def make_tiny_hybrid(
    path: str | os.PathLike[str] | None = None,
    *,
    layers: int = 4,
    hidden: int = 256,
    heads: int = 2,
    head_dim: int = 64,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    """Make (or reuse) a tiny random-weight Qwen3-Next and return its folder, cached as
    :func:`make_tiny_llama`'s models.

    Its layers alternate linear attention (Gated DeltaNet: a convolution and a recurrent
    state per request, no KV per token) and full attention, starting with linear; every
    layer's MLP is a mixture of 4 experts. ``heads`` and ``head_dim`` (elements) apply to
    both kinds of layer. vLLM's CPU platform serves it with ``dtype="bfloat16"`` only, and
    chooses the block size itself (128 tokens with :data:`HYBRID_ENGINE`).
    """
    _check_sizes(layers, heads, head_dim, vocab)
    return _make(TinyModelSpec(layers, hidden, heads, head_dim, vocab, seed, hybrid=True), path)


def _make(spec: TinyModelSpec, path: str | os.PathLike[str] | None) -> Path:
    root = Path(path) if path is not None else default_model_root()
    folder = root / spec.folder_name()
    if (folder / MARKER).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        _build(tmp, spec)
        (tmp / MARKER).write_text(json.dumps(asdict(spec), indent=2) + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished first; use its copy.
            if not (folder / MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def read_spec(folder: str | os.PathLike[str]) -> TinyModelSpec:
    """The parameters a tiny model folder was made with."""
    data = json.loads((Path(folder) / MARKER).read_text())
    return TinyModelSpec(**data)


def special_token_ids(folder: str | os.PathLike[str]) -> set[int]:
    """Token ids of the tokenizer's special tokens (never used in generated prompts)."""
    data = json.loads((Path(folder) / "tokenizer.json").read_text())
    return {int(t["id"]) for t in data.get("added_tokens", [])}
