"""``tokenmill bench multiturn``: chat conversations against a running server, turn after turn.

Each of ``--num-conversations`` conversations (run ``--max-concurrency`` at a time) plays ``--num-turns``
turns: the history so far (a system prompt of its own, then every user message and every answer the model
gave) plus a new user message, streamed through ``/v1/chat/completions``. Reported per turn index: the time
to first token (median and mean over conversations) and the share of prompt tokens the server served from
its prefix cache (``usage.prompt_tokens_details.cached_tokens`` over ``usage.prompt_tokens``). Run it against
a server with prefix caching on and one with ``--no-enable-prefix-caching`` to see what the cache buys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = [
    "river",
    "stone",
    "cloud",
    "lantern",
    "harbor",
    "meadow",
    "signal",
    "copper",
    "violet",
    "orchard",
    "falcon",
    "ember",
    "glacier",
]


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)


def _text(seed: int, num_words: int) -> str:
    return " ".join(WORDS[(seed * 7 + 3 * i + i * i) % len(WORDS)] for i in range(num_words))


async def _turn(
    client: httpx.AsyncClient, messages: list[dict[str, str]], args: argparse.Namespace
) -> tuple[Turn, str]:
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": args.answer_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft_s: float | None = None
    answer, usage = "", {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if ttft_s is None:
                        ttft_s = time.perf_counter() - start
                    answer += content
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    turn = Turn(ttft_s if ttft_s is not None else float("nan"), int(usage.get("prompt_tokens", 0)), cached)
    return turn, answer


async def _conversation(client: httpx.AsyncClient, index: int, args: argparse.Namespace) -> Conversation:
    conv = Conversation()
    messages = [{"role": "system", "content": f"Conversation {index}. " + _text(index, args.system_words)}]
    for k in range(args.num_turns):
        messages.append({"role": "user", "content": f"Turn {k}: " + _text(index * 31 + k, args.user_words)})
        turn, answer = await _turn(client, messages, args)
        conv.turns.append(turn)
        messages.append({"role": "assistant", "content": answer})
    return conv


async def run(args: argparse.Namespace) -> list[Conversation]:
    limit = asyncio.Semaphore(args.max_concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout) as client:

        async def one(i: int) -> Conversation:
            async with limit:
                return await _conversation(client, i, args)

        return await asyncio.gather(*(one(i) for i in range(args.num_conversations)))


def report(conversations: list[Conversation]) -> str:
    lines = ["turn  median TTFT ms  mean TTFT ms  prompt tokens  cached share"]
    num_turns = min(len(c.turns) for c in conversations)
    for k in range(num_turns):
        turns = [c.turns[k] for c in conversations]
        ttfts = [t.ttft_s * 1e3 for t in turns]
        prompt = sum(t.prompt_tokens for t in turns)
        cached = sum(t.cached_tokens for t in turns)
        lines.append(
            f"{k:>4}  {statistics.median(ttfts):>14.1f}  {statistics.fmean(ttfts):>12.1f}  "
            f"{prompt / len(turns):>13.0f}  {cached / max(prompt, 1):>11.1%}"
        )
    return "\n".join(lines)


def add_bench_multiturn_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    parser.add_argument("--num-conversations", type=int, default=8, help="conversations in the run")
    parser.add_argument("--num-turns", type=int, default=6, help="user turns per conversation")
    parser.add_argument("--max-concurrency", type=int, default=4, help="conversations in flight at once")
    parser.add_argument(
        "--system-words", type=int, default=120, help="words in each conversation's system prompt"
    )
    parser.add_argument("--user-words", type=int, default=30, help="words in each user message")
    parser.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of each answer")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")


def run_bench_multiturn(args: argparse.Namespace) -> int:
    for name in ("num_conversations", "num_turns", "max_concurrency", "answer_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer")
    conversations = asyncio.run(run(args))
    print(f"{args.num_conversations} conversations x {args.num_turns} turns against {args.base_url}")
    print(report(conversations))
    return 0
