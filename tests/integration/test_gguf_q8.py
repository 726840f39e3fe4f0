"""The embedded model with ``quantization="gguf-q8"``: its Q4_1 blocks multiplied by activations rounded to 8 bits
per group of 32 (the kernel itself is pinned against float64 in tests/unit/test_gguf_blocks.py). Here: the same
bytes as the exact path, close to it in distribution, and greedy tokens that depend neither on the batch nor on a
preemption (rounding turns any fp32 difference between two paths into a whole step, so the decode stack and the
eager forward must agree bit for bit)."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_hf import PROMPTS, PagedRunner

from tokenmill.engine import Engine
from tokenmill.model.quant import QuantizedLinear
from tokenmill.sampling_params import SamplingParams


def test_same_bytes_as_the_exact_path(embedded_q8, embedded_loaded) -> None:
    assert embedded_q8.quantization == "gguf-q8"
    assert embedded_q8.weight_bytes == embedded_loaded.weight_bytes
    q8_modules, exact_modules = (
        dict(embedded_q8.model.named_modules()),
        dict(embedded_loaded.model.named_modules()),
    )
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        proj = q8_modules[f"model.layers.0.{name}"]
        assert isinstance(proj, QuantizedLinear)
        assert set(proj.weight.type_summary().split("+")) == {"4bit/g32/x8"}  # q, k, v parts: all quads
        assert torch.equal(
            proj.weight.dequantize(), exact_modules[f"model.layers.0.{name}"].weight.dequantize()
        )
    assert embedded_q8.model.lm_head.weight.type_summary() == "8bit/g32"  # the Q8_0 head stays exact
    assert embedded_q8.model.backend.decode_stack is not None


def _logits(loaded, prompts):
    runner = PagedRunner(loaded.model, loaded.config, num_blocks=64, block_size=4)
    prefill = runner.step(dict(enumerate(prompts)))  # one flat batch of four prompts
    decode = runner.step({i: [int(t)] for i, t in enumerate(prefill.argmax(-1))})  # the decode stack
    return prefill, decode


def test_distribution_close_to_the_exact_path(embedded_q8, embedded_loaded) -> None:
    """Measured here: KL(exact || q8) at most 0.009 nats, the same argmax at every position."""
    prompts = [embedded_loaded.tokenizer.encode(p) for p in PROMPTS]
    for exact, q8 in zip(_logits(embedded_loaded, prompts), _logits(embedded_q8, prompts), strict=True):
        p, q = exact.log_softmax(-1), q8.log_softmax(-1)
        assert (p.exp() * (p - q)).sum(-1).max() < 0.05
        assert (exact.argmax(-1) == q8.argmax(-1)).sum() >= 3


@pytest.mark.parametrize("quantization", ["gguf", "gguf-q8"])
def test_decode_stack_equals_the_eager_forward_bit_for_bit(
    embedded_loaded, embedded_q8, quantization
) -> None:
    loaded = {"gguf": embedded_loaded, "gguf-q8": embedded_q8}[quantization]
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    _, with_stack = _logits(loaded, prompts)
    stack, loaded.model.backend.decode_stack = loaded.model.backend.decode_stack, None
    try:
        _, eager = _logits(loaded, prompts)
    finally:
        loaded.model.backend.decode_stack = stack
    assert torch.equal(with_stack, eager)


@pytest.mark.parametrize("chunk", [16, 512])
def test_greedy_tokens_depend_neither_on_the_batch_nor_on_preemption(embedded_q8, chunk) -> None:
    """With an fp32 KV cache. A 16-bit one rounds each stored K and V, which turns the fp32 summation-order
    difference between a token's decode step and its recompute after a preemption (the prefill kernel) into a
    whole unit of the 16-bit value now and then: the batch still changes nothing (the next test), a preemption
    may."""
    prompts = [embedded_q8.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = Engine(loaded=embedded_q8, device="cpu", block_size=16, num_kv_blocks=256, kv_cache_dtype="fp32")
    together = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    alone = [roomy.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    tight = Engine(
        loaded=embedded_q8,
        device="cpu",
        block_size=4,
        num_kv_blocks=20,
        max_num_batched_tokens=chunk,
        kv_cache_dtype="fp32",
    )
    preempted = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.stats.num_preemptions > 0
    assert tight.num_free_blocks == tight.num_total_blocks
    assert together == alone == preempted


@pytest.mark.parametrize("quantization", ["gguf", "gguf-q8"])
def test_a_verification_computes_its_tokens_as_decode_steps_do(
    embedded_loaded, embedded_q8, quantization
) -> None:
    """A speculative verification row (several tokens, not a prefill) attends token by token as decode rows, so
    each of its positions gets the hidden state a plain decode step gets there: on gguf-q8 bit for bit (a
    different path would turn fp32 rounding into a whole step of an 8-bit code and let a near-tie flip between
    speculation and plain decoding); on the exact path within fp32 rounding (its projections' sums run in an
    order that depends on the row count). Checked against one decode step per token, for the verification alone
    and beside another request's decode row."""
    from tokenmill.core.sched_output import ScheduledRow
    from tokenmill.model.loader import allocate_kv_cache
    from tokenmill.worker.forward import forward_rows

    loaded = {"gguf": embedded_loaded, "gguf-q8": embedded_q8}[quantization]
    prompt = loaded.tokenizer.encode(PROMPTS[0])
    following = loaded.tokenizer.encode(" and then the next words arrive")[:5]
    blocks, other_blocks = list(range(16)), list(range(16, 32))

    def run(rows, kv):
        with torch.no_grad():
            return forward_rows(loaded.model, rows, kv, 4, "cpu")  # [tokens, hidden]

    def prefilled():
        kv = allocate_kv_cache(loaded.config, 32, 4, loaded.dtype, "cpu")
        prompts = [
            ScheduledRow("a", prompt, 0, blocks, True, True),
            ScheduledRow("b", prompt, 0, other_blocks, True, True),
        ]
        run(prompts, kv)
        return kv

    kv = prefilled()
    start = len(prompt)
    stepwise = torch.cat(
        [run([ScheduledRow("a", [t], start + i, blocks, True, False)], kv) for i, t in enumerate(following)]
    )
    verified = run([ScheduledRow("a", following, start, blocks, True, False, num_spec_tokens=4)], prefilled())
    beside = run(
        [
            ScheduledRow("b", [following[0]], start, other_blocks, True, False),
            ScheduledRow("a", following, start, blocks, True, False, num_spec_tokens=4),
        ],
        prefilled(),
    )[1:]
    for got in (verified, beside):
        if quantization == "gguf-q8":
            assert torch.equal(got, stepwise)
        else:
            torch.testing.assert_close(got, stepwise, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kv_dtype"),
    [("auto", torch.float16), ("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8)],
)
def test_greedy_tokens_do_not_depend_on_the_batch_with_a_16_or_8_bit_kv_cache(
    embedded_q8, kv_cache_dtype, kv_dtype
) -> None:
    prompts = [embedded_q8.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = Engine(
        loaded=embedded_q8, device="cpu", block_size=16, num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype
    )
    assert engine.kv_dtype == kv_dtype
    together = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    alone = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert engine.num_free_blocks == engine.num_total_blocks
