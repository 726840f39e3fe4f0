"""Prefix caching on the embedded model: greedy outputs identical with it on and off (shared prefix,
multi-turn chat, preemption), a cache-hit request against transformers, the shared part computed once,
and the server's counts agreeing with the engine's."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from serverproc import ServerProcess

from tokenmill import SamplingParams

PREFIX = [(37 * i) % 5000 + 200 for i in range(300)]  # a 300-token shared prefix


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "kv_cache_dtype",
    [
        "auto",
        pytest.param("fp16", marks=pytest.mark.slow),
        pytest.param("int8", marks=pytest.mark.slow),
        pytest.param("fp8", marks=pytest.mark.slow),
    ],
)  # "auto" is fp16 on this arithmetic; the 8-bit caches share blocks in the default run through speculation's
# preemption test (slow: 6 s each)
def test_shared_prefix_batch_same_tokens_on_and_off(make_engine: Any, kv_cache_dtype: str) -> None:
    prompts = [PREFIX + [1000 + 7 * i + j for j in range(5 + i)] for i in range(6)]
    off = make_engine(max_model_len=512, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    on = make_engine(max_model_len=512, kv_cache_dtype=kv_cache_dtype)
    want = _tokens(off.generate(prompts[:1], greedy(6)) + off.generate(prompts[1:], greedy(6)))
    got = _tokens(on.generate(prompts[:1], greedy(6)) + on.generate(prompts[1:], greedy(6)))
    assert got == want
    assert off.stats.num_prefix_hit_tokens == 0
    assert on.stats.num_prefix_hit_tokens >= 5 * (300 // 16) * 16  # the later five found the prefix
    assert on.num_free_blocks == on.num_total_blocks
    on.check_integrity()


def test_multi_turn_chat_same_tokens_and_later_turns_hit(make_engine: Any) -> None:
    results = {}
    for caching in (False, True):
        engine = make_engine(max_model_len=512, enable_prefix_caching=caching)
        history = [{"role": "system", "content": "You are a terse assistant."}]
        answers, cached = [], []
        for turn in ("Name a colour.", "Another one.", "And a third?"):
            history.append({"role": "user", "content": turn})
            ids = engine.tokenizer.encode_chat(history)
            out = engine.generate([ids], greedy(8))[0]
            answers.append(list(out.outputs[0].token_ids))
            history.append({"role": "assistant", "content": out.outputs[0].text})
            cached.append(engine.stats.num_prefix_hit_tokens)
        results[caching] = (answers, cached)
    assert results[True][0] == results[False][0]
    hits = results[True][1]
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > hits[1]  # each turn reuses the previous ones


@pytest.mark.parametrize(
    "kv_cache_dtype",
    ["auto", pytest.param("int8", marks=pytest.mark.slow), pytest.param("fp8", marks=pytest.mark.slow)],
)
def test_preempted_and_resumed_same_tokens_on_and_off(make_engine: Any, kv_cache_dtype: str) -> None:
    prompts = [PREFIX[:40] + [300 + 3 * i + j for j in range(4 + 3 * i)] for i in range(8)]
    params = [greedy(8 + 3 * i) for i in range(8)]
    roomy = make_engine(num_kv_blocks=256, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    want = _tokens(roomy.generate(prompts, params))
    tight = make_engine(block_size=8, num_kv_blocks=16, max_num_seqs=6, kv_cache_dtype=kv_cache_dtype)
    got = _tokens(tight.generate(prompts, params))
    assert tight.stats.num_preemptions > 0
    assert tight.stats.num_prefix_hit_tokens > 0
    assert got == want
    tight.check_integrity()
    assert tight.num_free_blocks == tight.num_total_blocks


def test_cache_hit_request_matches_transformers(make_engine: Any, hf_embedded: Any) -> None:
    model, _ = hf_embedded
    prompt = PREFIX[:100] + [4000 + j for j in range(7)]
    engine = make_engine(max_model_len=512)
    engine.generate([PREFIX[:100] + [17, 18]], greedy(2))  # puts the first 96 tokens' blocks in the cache
    before = engine.stats.num_prefix_hit_tokens
    out = engine.generate([prompt], greedy(8))[0]
    assert engine.stats.num_prefix_hit_tokens - before == 96
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert list(out.outputs[0].token_ids) == ref.tolist()


def test_shared_system_prompt_is_computed_once(make_engine: Any) -> None:
    system = PREFIX + PREFIX[:100]  # 400 tokens
    engine = make_engine(max_model_len=512, max_num_batched_tokens=512)
    prompts = [system + [2000 + 11 * i + j for j in range(6)] for i in range(32)]
    engine.generate(prompts, greedy(2))
    per_request = (400 // 16) * 16
    # The first request computes it; one admitted in the same step (its blocks not yet written) may too.
    assert engine.stats.num_prefix_hit_tokens >= 30 * per_request
    assert engine.stats.num_prefill_tokens <= 2 * 400 + 32 * (6 + 16)
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.fixture(scope="module")
def server() -> Any:
    proc = ServerProcess("--max-num-seqs", "4").start()
    yield proc
    proc.stop()


def test_server_cached_tokens_agree_with_the_metrics(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/completions"
    prompt = " ".join(["alpha beta gamma"] * 40)
    before = server.metric("vllm:prefix_cache_hits_total")
    first = httpx.post(url, json={"prompt": prompt, "max_tokens": 2}, timeout=60).json()["usage"]
    second = httpx.post(url, json={"prompt": prompt, "max_tokens": 2}, timeout=60).json()["usage"]
    salted = httpx.post(
        url, json={"prompt": prompt, "max_tokens": 2, "cache_salt": "other"}, timeout=60
    ).json()
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (second["prompt_tokens"] - 1) // 16 * 16 > 0
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another salt shares nothing
    assert server.metric("vllm:prefix_cache_hits_total") - before == cached
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    for _ in range(2):
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=chat, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"cached_tokens":' in lines[-1] and '"cached_tokens":0' not in lines[-1]


def test_multiturn_bench_reports_the_cache_share_per_turn(server: ServerProcess) -> None:
    import argparse

    from tokenmill.bench.multiturn import add_bench_multiturn_arguments, report, run

    parser = argparse.ArgumentParser()
    add_bench_multiturn_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url",
            server.base_url,
            "--num-conversations",
            "2",
            "--num-turns",
            "3",
            "--answer-tokens",
            "4",
        ]
    )
    import asyncio

    conversations = asyncio.run(run(args))
    assert [len(c.turns) for c in conversations] == [3, 3]
    for c in conversations:
        assert c.turns[0].cached_tokens == 0 and 0 < c.turns[1].cached_tokens < c.turns[2].cached_tokens
        assert all(t.ttft_s > 0 for t in c.turns)
    text = report(conversations)
    assert text.splitlines()[0].startswith("turn") and len(text.splitlines()) == 4
