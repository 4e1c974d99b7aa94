"""The demo's command line: clear errors for bad arguments, sizes read from the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.demo.__main__ import format_table, main
from kvtier.demo.model import ModelError, read_model
from kvtier.demo.workloads import Row, WorkloadReport


def test_missing_model_folder_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "--model" in capsys.readouterr().err


def test_folder_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"no config\.json"):
        read_model(tmp_path)


def test_config_without_sizes_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelError, match="num_hidden_layers"):
        read_model(tmp_path)


def test_out_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        main(["--out", str(f)])


def test_block_bytes_follow_the_model(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
           "hidden_size": 2048, "head_dim": 128, "vocab_size": 151936,
           "max_position_embeddings": 40960, "eos_token_id": 151645}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sizes = read_model(tmp_path)
    # K and V, 28 layers, 8 KV heads of 128 elements, float32, 32 tokens per block.
    assert sizes.kv_bytes_per_block == 2 * 28 * 8 * 128 * 4 * 32
    assert 151645 in sizes.special_ids


def test_table_marks_a_run_that_differs() -> None:
    report = WorkloadReport(
        "w", "d", 1, 10, 10,
        [Row("reference"), Row("kvtier", outputs_match=False, restored_or_hit={"restored": 5})],
    )  # fmt: skip
    text = format_table(report)
    assert "DIFFER" in text and "restored 5" in text and "matches the reference: NO" in text
