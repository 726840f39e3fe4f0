"""Tensor parallelism on CPU: two gloo processes on this machine. Greedy tokens equal TP=1's on the embedded
model (through preemption and an abort) and on a tiny untied model, logprobs within fp32 tolerance; a worker
that dies ends the next step with an error naming it, within seconds; sizes that cannot split are refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_model_vs_hf import _save_with_tokenizer, _tiny_hf_model

from tokenmill.config import EngineConfig
from tokenmill.engine import Engine
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def _run(engine: Engine, prompts, params: SamplingParams, abort_second: bool = False) -> dict[str, list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens[delta.request_id] += delta.new_token_ids
        steps += 1
        if abort_second and steps == 3:
            engine.abort(ids[1])
    engine.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks
    return {i: tokens[i] for i in ids}


def test_embedded_model_tp2_equals_tp1_through_preemption_and_abort() -> None:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    small = dict(device="cpu", quantization="fp32", block_size=4, num_kv_blocks=13, max_num_batched_tokens=16)
    one = Engine(EngineConfig(**small))
    expected = _run(one, PROMPTS, params, abort_second=True)
    assert one.stats.num_preemptions > 0
    two = Engine(EngineConfig(**small, tensor_parallel_size=2))
    try:
        got = _run(two, PROMPTS, params, abort_second=True)
        assert two.stats.num_preemptions > 0
        assert list(got.values()) == list(expected.values())
        assert two.runner.kv_caches[0][0].shape[2] == 2  # rank 0 holds 2 of the 3 KV heads
    finally:
        two.close()


@pytest.mark.slow  # 7 s; rows reach the workers as in the default run's preemption test
def test_tp2_with_ngram_speculation_equals_tp1() -> None:
    """Rows carrying proposed tokens reach the workers as any rows do; verification runs on rank 0."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["the quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3, 1, 2, 3, 1, 2, 3,"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    base = dict(device="cpu", quantization="fp32", num_kv_blocks=64)
    expected = _run(Engine(EngineConfig(**base)), prompts, params)
    two = Engine(EngineConfig(**base, tensor_parallel_size=2, speculative_config=spec))
    try:
        got = _run(two, prompts, params)
        assert two.stats.num_spec_accepted_tokens > 0
        assert list(got.values()) == list(expected.values())
    finally:
        two.close()


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kv_dtype"),
    [  # 8 s each: with the slow tests (the fp16 default's split runs in the default run's other TP tests)
        pytest.param("bf16", "torch.bfloat16", marks=pytest.mark.slow),
        pytest.param("int8", "torch.int8", marks=pytest.mark.slow),
        pytest.param("fp8", "torch.float8_e4m3fn", marks=pytest.mark.slow),
    ],
)
def test_tp2_on_a_16_or_8_bit_kv_cache_equals_tp1(kv_cache_dtype: str, kv_dtype: str) -> None:
    """Every rank keeps its heads' K and V in the engine's KV dtype (int8: each head's row with its own scale, so
    a split of the heads changes no byte); the same greedy tokens as one process."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = dict(device="cpu", quantization="fp32", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    one = Engine(EngineConfig(**base))
    assert str(one.kv_dtype) == kv_dtype
    expected = _run(one, PROMPTS, params)
    two = Engine(EngineConfig(**base, tensor_parallel_size=2))
    try:
        assert str(two.runner.kv_caches[0][0].dtype) == kv_dtype
        assert list(_run(two, PROMPTS, params).values()) == list(expected.values())
    finally:
        two.close()


def test_tiny_untied_model_tp2_logprobs_match(tmp_path: Path) -> None:
    _save_with_tokenizer(_tiny_hf_model(tie=False, seed=5), tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 11, 20], [7] * 13]
    base = dict(model=str(tmp_path), device="cpu", num_kv_blocks=64)
    one = Engine(EngineConfig(**base)).generate(prompts, params)
    engine = Engine(EngineConfig(**base, tensor_parallel_size=2))
    try:
        two = engine.generate(prompts, params)
    finally:
        engine.close()
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) < 1e-4
            assert [t for t, _ in la.top_logprobs] == [t for t, _ in lb.top_logprobs]
            for (_, x), (_, y) in zip(la.top_logprobs, lb.top_logprobs):
                assert abs(x - y) < 1e-4


def test_a_dead_worker_ends_the_engine_with_an_error() -> None:
    engine = Engine(EngineConfig(device="cpu", quantization="fp32", num_kv_blocks=64, tensor_parallel_size=2))
    try:
        engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0))
        engine.tp_group.workers[0].kill()
        engine.tp_group.workers[0].join(timeout=10)
        start = time.monotonic()
        engine.add_request("Hello again", SamplingParams(max_tokens=4, temperature=0))
        result = engine.step()
        assert result.error is not None and "worker 1 died" in str(result.error)
        assert time.monotonic() - start < 10
    finally:
        engine.close()


def test_sizes_that_cannot_split_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        Engine(EngineConfig(device="cpu", quantization="fp32", num_kv_blocks=8, tensor_parallel_size=4))
    with pytest.raises(ValueError, match="fp32 weights"):
        EngineConfig(quantization="int8", tensor_parallel_size=2)


@pytest.mark.gpu
def test_nccl_tp2_equals_tp1_on_two_gpus() -> None:
    """The CUDA path (NCCL, one device per rank), run by benchmarks/gpu_check.sh; needs two GPUs."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices, found {torch.cuda.device_count()}")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    base = dict(device="cuda", dtype="float32", quantization="fp32", num_kv_blocks=128)
    expected = _run(Engine(EngineConfig(**base)), PROMPTS, params)
    two = Engine(EngineConfig(**base, tensor_parallel_size=2))
    try:
        assert list(_run(two, PROMPTS, params).values()) == list(expected.values())
    finally:
        two.close()
