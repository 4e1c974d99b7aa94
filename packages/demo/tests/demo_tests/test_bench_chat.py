"""The chat benchmark's client: conversations that grow by each reply, streamed through a
real ``vllm serve``, with time to first token measured per turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.demo.bench_chat import ChatResult, ChatWorkload, Turn, run_chat
from kvtier.demo.bench_e2e import server_args
from kvtier.testkit import requires_vllm
from kvtier.testkit.server import VllmServer

SMALL = ChatWorkload(
    users=2,
    turns=3,
    first_message_tokens=48,
    message_tokens=16,
    reply_tokens=8,
    arrival_gap_s=0.1,
    think_s=0.1,
)


def test_messages_have_the_configured_lengths() -> None:
    messages = SMALL.messages()
    assert [len(m) for m in messages[0]] == [48, 16, 16]
    assert len(messages) == 2
    assert messages[0] != messages[1], "every user needs their own conversation"
    assert SMALL.messages() == messages, "the workload must be the same in every run"
    assert SMALL.longest_prompt_tokens == 48 + 2 * (16 + 8)
    assert all(3 <= t < SMALL.vocab for m in messages for turn in m for t in turn)


def test_ttft_percentiles_and_throughput() -> None:
    result = ChatResult(
        turns=[Turn(0, i, 10, ttft, 1.0, [1] * 4) for i, ttft in enumerate([0.1, 0.2, 0.3, 0.4])],
        wall_s=2.0,
    )
    assert result.ttft_percentile(50) == pytest.approx(0.25)
    assert result.ttft_percentile(90) == pytest.approx(0.37)
    assert result.output_tokens_per_s() == pytest.approx(8.0)


def test_server_args_spell_booleans_as_vllm_flags() -> None:
    args = server_args(
        {"enforce_eager": True, "enable_prefix_caching": False, "block_size": 32}, None
    )
    assert args == ["--enforce-eager", "--no-enable-prefix-caching", "--block-size", "32"]


@pytest.mark.e2e
@requires_vllm
def test_chat_resends_the_conversation_and_streams_replies(tiny_model: Path) -> None:
    args = ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--seed", "0",
            "--max-model-len", "256", "--gpu-memory-utilization", "0.2"]  # fmt: skip
    with VllmServer(tiny_model, args) as server:
        first = run_chat(server.base_url, str(tiny_model), SMALL)
        again = run_chat(server.base_url, str(tiny_model), SMALL)
    assert not first.errors, first.errors
    assert len(first.turns) == SMALL.users * SMALL.turns
    assert all(len(t.reply) == SMALL.reply_tokens for t in first.turns)
    assert all(0 < t.ttft_s <= t.seconds for t in first.turns)
    # Each turn's prompt is the previous prompt, its reply and the new message.
    for t in first.turns:
        expected = SMALL.first_message_tokens + t.turn * (SMALL.message_tokens + SMALL.reply_tokens)
        assert t.prompt_tokens == expected, (t.user, t.turn, t.prompt_tokens)
    assert first.replies() == again.replies(), "greedy replies must repeat exactly"
