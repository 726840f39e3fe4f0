"""The suite's cases as token-id prompts and output lengths, identical for every engine.

Prompts are random token ids drawn from a fixed seed (ordinary vocabulary, no special tokens), except
case (c), which is a short chat prompt. Every request runs greedily with ``ignore_eos``: each engine
computes exactly ``max_tokens`` tokens for it.

====  ==================================================================================================
case  shape
====  ==================================================================================================
a     the seed's 8 requests: 5-token prompts, seven want 4 tokens, one wants 32
b     offline mix: 64 requests, prompts 32-256 tokens, outputs 16-128 tokens
c     single stream: 128 tokens after a short chat prompt
d     prefill: one 1,024-token prompt, one output token (time to first token)
e     larger closed batch: 256 requests shaped like (b)
====  ==================================================================================================

``quick=True`` shrinks every case to a smoke-test size (seconds, not minutes).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

ALL_CASES = ("a", "b", "c", "d", "e")
CHAT_MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
# Ids below this are SmolLM2's special and byte tokens; random prompts stay clear of them.
_FIRST_ORDINARY_ID = 256


@dataclass(frozen=True)
class Workload:
    case: str
    title: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def is_single_stream(self) -> bool:
        return self.num_requests == 1

    def describe(self) -> str:
        return (
            f"({self.case}) {self.title}: {self.num_requests} requests, {self.num_prompt_tokens} prompt tokens, "
            f"{self.num_output_tokens} output tokens"
        )


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab_size) for _ in range(length)]


def mix(
    case: str,
    title: str,
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> Workload:
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        prompts.append(random_prompt(rng, rng.randint(*prompt_range), vocab_size))
        max_tokens.append(rng.randint(*output_range))
    return Workload(case, title, prompts, max_tokens)


def build(
    case: str, vocab_size: int, chat_prompt: Sequence[int], quick: bool = False, seed: int = 0
) -> Workload:
    """One case; ``chat_prompt`` is the tokenized ``CHAT_MESSAGES`` (case c)."""
    if case == "a":
        rng = random.Random(seed)
        prompts = [random_prompt(rng, 5, vocab_size) for _ in range(8)]
        return Workload("a", "seed shape", prompts, [4] * 7 + [32])
    if case == "b":
        if quick:
            return mix("b", "offline mix", 8, (16, 48), (4, 16), vocab_size, seed + 1)
        return mix("b", "offline mix", 64, (32, 256), (16, 128), vocab_size, seed + 1)
    if case == "c":
        return Workload("c", "single-stream decode", [list(chat_prompt)], [16 if quick else 128])
    if case == "d":
        rng = random.Random(seed + 3)
        length = 128 if quick else 1024
        return Workload("d", "prefill", [random_prompt(rng, length, vocab_size)], [1])
    if case == "e":
        if quick:
            return mix("e", "larger closed batch", 16, (16, 48), (4, 16), vocab_size, seed + 4)
        return mix("e", "larger closed batch", 256, (32, 256), (16, 128), vocab_size, seed + 4)
    raise ValueError(f"unknown case {case!r}; choose from {', '.join(ALL_CASES)}")
