"""Multi-turn chat through ``vllm serve`` and the ``openai`` client: time to first token.

Each simulated user opens a conversation with a long first message (a pasted
document), then asks short follow-ups. Every turn resends the whole conversation so
far, as a chat client does: the server sees the previous turns as a prefix it may
still hold. Users arrive a fixed gap apart and pause ("think") between a reply and
their next message, so requests arrive over time and overlap.

The conversation is sent as token ids through the completions API (what a chat
template renders into), which keeps every prompt's length exact and makes the
greedy replies comparable token by token between servers. Time to first token
(TTFT) is measured on the client from sending a request to the first streamed
token.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ChatWorkload:
    """Conversations as token ids.

    Attributes:
        users: concurrent conversations.
        turns: messages each user sends.
        first_message_tokens: tokens of a user's first message.
        message_tokens: tokens of each later message.
        reply_tokens: tokens the server generates per turn (greedy, EOS ignored).
        arrival_gap_s: seconds between two users' first messages.
        think_s: seconds a user waits after a reply before the next message.
    """

    users: int = 6
    turns: int = 4
    first_message_tokens: int = 512
    message_tokens: int = 64
    reply_tokens: int = 32
    arrival_gap_s: float = 1.0
    think_s: float = 2.0
    vocab: int = 512
    seed: int = 3

    @property
    def longest_prompt_tokens(self) -> int:
        """Tokens of the last turn's prompt (the longest)."""
        return self.first_message_tokens + (self.turns - 1) * (
            self.message_tokens + self.reply_tokens
        )

    def messages(self) -> list[list[list[int]]]:
        """``messages()[user][turn]``: the token ids the user sends in that turn."""
        rng = random.Random(self.seed)

        def text(n: int) -> list[int]:
            return [rng.randrange(3, self.vocab) for _ in range(n)]  # 0-2: special tokens

        return [
            [text(self.first_message_tokens if t == 0 else self.message_tokens)
             for t in range(self.turns)]
            for _ in range(self.users)
        ]  # fmt: skip


@dataclass
class Turn:
    user: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    seconds: float
    reply: list[int]


@dataclass
class ChatResult:
    """What one server run of a :class:`ChatWorkload` measured."""

    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def replies(self) -> list[list[int]]:
        """Reply token ids ordered by (user, turn)."""
        return [t.reply for t in sorted(self.turns, key=lambda t: (t.user, t.turn))]

    def ttft_percentile(self, q: float) -> float:
        """TTFT in seconds at percentile ``q`` (0-100) over every turn."""
        values = sorted(t.ttft_s for t in self.turns)
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0]
        return float(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1])

    def output_tokens_per_s(self) -> float:
        """Generated tokens over the run's wall seconds."""
        out = sum(len(t.reply) for t in self.turns)
        return out / self.wall_s if self.wall_s else 0.0


def _stream_turn(
    client: Any, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[int]]:
    """Send one turn; return (seconds to the first token, reply token ids)."""
    start = time.perf_counter()
    first: float | None = None
    reply: list[int] = []
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            ids = getattr(choice, "token_ids", None) or []
            if ids and first is None:
                first = time.perf_counter() - start
            reply.extend(int(i) for i in ids)
    if first is None:
        raise RuntimeError("the server streamed no token ids")
    return first, reply


def run_chat(base_url: str, model: str, workload: ChatWorkload, progress: Any = None) -> ChatResult:
    """Play every user's conversation against the server at ``base_url`` (``.../v1``).

    One thread per user. A failed turn ends that user's conversation and is recorded
    in ``errors``. ``progress`` (a tqdm bar, optional) advances once per turn.
    """
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    messages = workload.messages()
    result = ChatResult()
    lock = threading.Lock()
    t0 = time.perf_counter()

    def user(u: int) -> None:
        time.sleep(u * workload.arrival_gap_s)
        conversation: list[int] = []
        for t, message in enumerate(messages[u]):
            conversation = conversation + message
            try:
                turn_start = time.perf_counter()
                ttft, reply = _stream_turn(client, model, conversation, workload.reply_tokens)
                seconds = time.perf_counter() - turn_start
            except Exception as exc:  # recorded; the run is then reported as failed
                with lock:
                    result.errors.append(f"user {u} turn {t}: {exc}")
                return
            with lock:
                result.turns.append(Turn(u, t, len(conversation), ttft, seconds, reply))
                if progress is not None:
                    progress.update(1)
            conversation = conversation + reply
            if t + 1 < workload.turns:
                time.sleep(workload.think_s)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(workload.users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    result.wall_s = time.perf_counter() - t0
    return result


def serve_chat(
    model: Path,
    server_args: Sequence[str],
    workload: ChatWorkload,
    *,
    progress: Any = None,
    log_path: Path | None = None,
) -> tuple[ChatResult, str]:
    """Start ``vllm serve`` with ``server_args``, play the chat, stop the server.

    Returns the result and the server's ``/metrics`` text at the end of the run.
    """
    from kvtier.testkit.server import VllmServer

    with VllmServer(model, list(server_args), log_path=log_path) as server:
        result = run_chat(server.base_url, str(model), workload, progress)
        metrics = server.metrics()
    return result, metrics
