"""The tiny model: made offline, cached per parameter set, written atomically."""

import json
from pathlib import Path

import pytest

from kvtier.testkit import TinyModelSpec, make_tiny_llama, read_spec, special_token_ids


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def test_made_model_has_weights_config_and_tokenizer(model_root: Path) -> None:
    folder = make_tiny_llama(model_root)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "kvtier-tiny-model.json"):
        assert (folder / name).is_file(), f"{name} missing from {folder}"
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 128
    assert config["head_dim"] == 64 and config["vocab_size"] == 512
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_second_call_reuses_the_model(model_root: Path) -> None:
    first = make_tiny_llama(model_root)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = make_tiny_llama(model_root)
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp, "model was rebuilt"
    leftovers = [p.name for p in model_root.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporary folders left behind: {leftovers}"


def test_different_parameters_get_different_folders(model_root: Path) -> None:
    assert make_tiny_llama(model_root) != make_tiny_llama(model_root, seed=1)


def test_sliding_window_makes_a_mistral(model_root: Path) -> None:
    folder = make_tiny_llama(model_root, sliding_window=64)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == 64
    assert read_spec(folder).sliding_window == 64


def test_eos_logit_row_is_zero(model_root: Path) -> None:
    from safetensors.torch import load_file

    folder = make_tiny_llama(model_root)
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["lm_head.weight"][eos].abs().sum().item() == 0.0
    assert weights["lm_head.weight"].abs().sum().item() > 0.0


def test_tokenizer_round_trips_text(model_root: Path) -> None:
    from transformers import AutoTokenizer

    folder = make_tiny_llama(model_root)
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == 512
    ids = tok.encode("hello kvtier", add_special_tokens=False)
    assert tok.decode(ids) == "hello kvtier"
    assert special_token_ids(folder) == {tok.unk_token_id, tok.bos_token_id, tok.eos_token_id}


def test_spec_folder_name_is_stable() -> None:
    assert TinyModelSpec().folder_name() == TinyModelSpec().folder_name()
    assert TinyModelSpec(sliding_window=64).folder_name().startswith("tiny-mistral")


def test_too_small_vocab_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab"):
        make_tiny_llama(tmp_path, vocab=100)


def test_env_variable_sets_the_default_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.testkit import default_model_root

    monkeypatch.setenv("KVTIER_TINY_MODEL_DIR", str(tmp_path))
    assert default_model_root() == tmp_path


def test_mla_makes_a_dense_deepseek_v2_with_a_576_element_kv_row(model_root: Path) -> None:
    from kvtier.testkit import make_tiny_mla

    folder = make_tiny_mla(model_root)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    # vLLM's CPU MLA kernel takes this KV row width only.
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert config["first_k_dense_replace"] >= config["num_hidden_layers"], "experts would run"
    assert read_spec(folder).mla and folder != make_tiny_llama(model_root)
    # Models made before the mla field keep their cached folders.
    assert TinyModelSpec().folder_name() == "tiny-llama-l2-h128-49a7082e4872"


def test_positions_sets_the_longest_sequence(model_root: Path) -> None:
    folder = make_tiny_llama(model_root, positions=2048)
    config = json.loads((folder / "config.json").read_text())
    assert config["max_position_embeddings"] == 2048
    assert read_spec(folder).positions == 2048 and folder != make_tiny_llama(model_root)
    # Models of the first length keep their cached folders.
    assert TinyModelSpec(positions=1024).folder_name() == "tiny-llama-l2-h128-49a7082e4872"
    with pytest.raises(ValueError, match="positions"):
        make_tiny_llama(model_root, positions=8)
