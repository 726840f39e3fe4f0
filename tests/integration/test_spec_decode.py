"""Speculative decoding (n-gram prompt lookup) on the embedded model: greedy outputs identical to plain
decoding's, through stop strings, stop tokens, max_tokens, logprobs, structured outputs, a pool tight enough
to preempt, prefix caching and the server's streaming; its counts in the stats and in /metrics."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

# disable_by_batch_size 0: proposals at every batch size, so the batched tests verify them too
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "disable_by_batch_size": 0,
}
CODE = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n"
)


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def engines(make_engine):
    return make_engine(), make_engine(speculative_config=SPEC)


@pytest.fixture(scope="module")
def prompts(engines):
    plain = engines[0]
    tokenize = plain.tokenizer.encode
    return [
        _chat(plain, f"Add type hints to this function:\n```python\n{CODE}```"),
        tokenize("the quick brown fox jumps over the lazy dog. " * 3),  # the model keeps repeating it
        _chat(
            plain, "Copy this text exactly: 'The lighthouse was built in 1871 from granite quarried inland.'"
        ),
        _chat(plain, "What is the capital of France?"),
    ]


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_outputs_are_identical_and_proposals_are_accepted(engines, prompts) -> None:
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=96)
    before = spec.stats.totals()
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert _ids(got) == _ids(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    stats = spec.stats
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    drafts = stats.num_spec_drafts - before.num_spec_drafts
    assert accepted > 20 and drafts > 5  # the code and the repeated sentence are copied
    assert sum(stats.spec_accepted_per_pos) == stats.num_spec_accepted_tokens
    assert stats.spec_accepted_per_pos == sorted(stats.spec_accepted_per_pos, reverse=True)  # j+1 needs j
    assert stats.spec_mean_acceptance_length > 2.0  # more than one proposed token kept per verification
    assert spec.num_free_blocks == spec.num_total_blocks  # every block back, rejected tokens' included


def test_stops_and_lengths_never_overshoot(engines, prompts) -> None:
    plain, spec = engines
    full = plain.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=80))
    for output in full:
        ids, text = output.outputs[0].token_ids, output.outputs[0].text
        stop_text = text[len(text) // 2 : len(text) // 2 + 6]
        for params in (
            SamplingParams(temperature=0.0, max_tokens=80, stop=[stop_text]),
            SamplingParams(temperature=0.0, max_tokens=80, stop=[stop_text], include_stop_str_in_output=True),
            SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=[ids[len(ids) // 2]]),
            *(SamplingParams(temperature=0.0, max_tokens=n) for n in (1, 2, 5, 13)),
        ):
            want = plain.generate([output.prompt_token_ids], params)[0].outputs[0]
            got = spec.generate([output.prompt_token_ids], params)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
                want.stop_reason,
            ), params
    assert spec.num_free_blocks == spec.num_total_blocks


def test_a_stop_string_before_the_steps_last_token_wins(engines, prompts) -> None:
    """A stop string completed by a verified token while the step's later token reaches max_tokens or EOS: the
    request ends at the string (its tokens, finish_reason "stop", stop_reason the string), as without speculation."""
    plain, spec = engines
    output = plain.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=60))[0]
    text = output.outputs[0].text
    num_checked = 0
    for start in (len(text) // 3, 2 * len(text) // 3):
        stop_text = text[start : start + 3]
        stopped = plain.generate(
            [output.prompt_token_ids], SamplingParams(temperature=0.0, max_tokens=60, stop=[stop_text])
        )[0].outputs[0]
        assert stopped.finish_reason == "stop"
        num_to_stop = len(stopped.token_ids)
        for extra in (1, 2, 3):  # max_tokens a few tokens past the stop string: a proposal spans both
            params = SamplingParams(temperature=0.0, max_tokens=num_to_stop + extra, stop=[stop_text])
            want = plain.generate([output.prompt_token_ids], params)[0].outputs[0]
            got = spec.generate([output.prompt_token_ids], params)[0].outputs[0]
            assert want.finish_reason == "stop" and want.stop_reason == stop_text
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids,
                want.text,
                want.finish_reason,
                want.stop_reason,
            ), (stop_text, extra)
            num_checked += 1
    assert num_checked == 6
    assert spec.num_free_blocks == spec.num_total_blocks


def test_logprobs_for_every_emitted_token(engines, prompts) -> None:
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=3)
    want, got = plain.generate(prompts[:2], params), spec.generate(prompts[:2], params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lg.token_id == lw.token_id
            assert lg.logprob == pytest.approx(lw.logprob, abs=2e-3)
            assert [t for t, _ in lg.top_logprobs] == [t for t, _ in lw.top_logprobs]


def test_structured_outputs_with_proposals(engines) -> None:
    plain, spec = engines
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["name", "tags"],
    }
    prompt = _chat(
        plain, 'Give JSON for the fox: {"name": "fox", "tags": ["quick", "brown", "quick", "brown"]}'
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema)
    )
    want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    value = json.loads(got.outputs[0].text)
    assert set(value) == {"name", "tags"}


def test_preemption_and_prefix_caching_with_proposals(make_engine, engines, prompts) -> None:
    plain = engines[0]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batch = [prompts[0], prompts[1], prompts[0], prompts[1], prompts[2], prompts[0]]
    want = _ids(plain.generate(batch, params))
    tight = make_engine(speculative_config=SPEC, num_kv_blocks=30)
    got = _ids(tight.generate(batch, params))
    assert got == want
    assert tight.stats.num_preemptions > 0
    assert tight.stats.num_prefix_hit_tokens > 0
    assert tight.stats.num_spec_accepted_tokens > 0
    assert tight.num_free_blocks == tight.num_total_blocks
    tight.check_integrity()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_proposals_preemption_and_prefix_caching_on_an_8_bit_kv_cache(
    embedded_q8, prompts, kv_cache_dtype
) -> None:
    """Under the default arithmetic, verification rows read and write 8-bit K and V as plain decode steps do: the
    same greedy tokens as plain decoding on that cache. (The exact path's projections are not bit for bit the same
    over 1 and 4 rows; a 64-token greedy output there may part at a near tie on any KV dtype.) Under preemption a request's K and V are computed again by the prefill kernel, whose
    fp32 sums differ in their last bits from the decode steps' and so may land on the other side of an 8-bit
    rounding: the requests never preempted keep their tokens, the preempted ones finish at their length."""
    from tokenmill.engine import Engine

    def make_engine(**overrides):
        return Engine(loaded=embedded_q8, device="cpu", **{"num_kv_blocks": 256, **overrides})

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batch = [prompts[0], prompts[1], prompts[0], prompts[2]]
    want = _ids(make_engine(kv_cache_dtype=kv_cache_dtype).generate(batch, params))
    roomy = make_engine(speculative_config=SPEC, kv_cache_dtype=kv_cache_dtype)
    assert roomy.kv_dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert _ids(roomy.generate(batch, params)) == want
    assert roomy.stats.num_spec_accepted_tokens > 0
    tight = make_engine(speculative_config=SPEC, num_kv_blocks=30, kv_cache_dtype=kv_cache_dtype)
    outs = tight.generate(batch, params)
    assert tight.stats.num_preemptions > 0 and tight.stats.num_prefix_hit_tokens > 0
    kept = [o.outputs[0].token_ids == w for o, w in zip(outs, want) if o.metrics.num_preemptions == 0]
    assert kept and all(kept)
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    assert tight.num_free_blocks == tight.num_total_blocks
    tight.check_integrity()


def test_server_streams_and_exports_the_counts() -> None:
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from serverproc import ServerProcess

    proc = ServerProcess("--max-model-len", "1024", "--speculative-config", json.dumps(SPEC)).start()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"Add type hints to this function:\n```python\n{CODE}```"}]
        model = "SmolLM2-135M-Instruct"
        full = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=64)
        pieces = []
        for chunk in client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=64, stream=True
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
        assert "".join(pieces) == full.choices[0].message.content
        text = httpx.get(f"{proc.base_url}/metrics", timeout=5.0).text
    finally:
        proc.stop()
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    drafts = samples[("vllm:spec_decode_num_drafts_total", None)]
    proposed = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)]
    assert sum(per_pos) == accepted


# --- draft model: the embedded model drafting for itself (the same vocabulary, greedy drafts it agrees with) ----
@pytest.fixture(scope="module")
def drafting(make_engine, embedded_loaded):
    spec = {"method": "draft_model", "model": embedded_loaded.source, "num_speculative_tokens": 3}
    return make_engine(speculative_config={**spec, "disable_by_batch_size": 0})


def test_draft_model_outputs_are_identical(engines, drafting, prompts) -> None:
    plain = engines[0]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want, got = plain.generate(prompts, params), drafting.generate(prompts, params)
    assert _ids(got) == _ids(want)
    stats = drafting.stats
    assert stats.num_spec_drafts > 10
    # a model drafting for itself is right nearly always (rows of 1 and of 4 tokens round a little differently)
    assert stats.spec_acceptance_rate > 0.9
    assert drafting.num_free_blocks == drafting.num_total_blocks
    assert drafting.runner.drafter.p_min == 0.5  # draft_p_min's default
    # the draft's weights: every block 4-bit with 8-bit activations (its Q4_1 file is already 4-bit)
    if drafting.loaded.quantization == "gguf":
        assert drafting.draft.quantization == "gguf-q4"


def test_the_draft_takes_the_quantization_asked_for(make_engine, engines, embedded_loaded, prompts) -> None:
    """``speculative_config.quantization`` (vLLM's key): the draft loads that way; the outputs stay the target's."""
    if embedded_loaded.quantization != "gguf":
        pytest.skip("the embedded model runs without the GGUF block kernels here")
    spec = {"method": "draft_model", "model": embedded_loaded.source, "quantization": "gguf"}
    engine = make_engine(speculative_config={**spec, "disable_by_batch_size": 0})
    assert engine.draft.quantization == "gguf"
    params = SamplingParams(temperature=0.0, max_tokens=24)
    assert _ids(engine.generate(prompts[:2], params)) == _ids(engines[0].generate(prompts[:2], params))
    assert engine.stats.spec_acceptance_rate > 0.9  # the exact draft is the target itself


@pytest.mark.slow  # 7 s; a draft model's outputs against plain decoding run by default above
def test_draft_model_under_preemption_and_with_stops(make_engine, engines, embedded_loaded, prompts) -> None:
    plain = engines[0]
    spec = {
        "method": "draft_model",
        "model": embedded_loaded.source,
        "num_speculative_tokens": 4,
        "disable_by_batch_size": 0,
        "draft_p_min": 0,  # every slot drafted: the most rejected tokens' slots to give back
    }
    tight = make_engine(speculative_config=spec, num_kv_blocks=30)
    assert tight.runner.drafter.p_min == 0.0
    batch = [prompts[0], prompts[1], prompts[3], prompts[0], prompts[2]]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    assert _ids(tight.generate(batch, params)) == _ids(plain.generate(batch, params))
    assert tight.stats.num_preemptions > 0 and tight.stats.num_spec_accepted_tokens > 0
    assert tight.num_free_blocks == tight.num_total_blocks
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop=["fox"])
    assert [o.outputs[0].text for o in tight.generate(prompts[1:2], stop)] == [
        o.outputs[0].text for o in plain.generate(prompts[1:2], stop)
    ]


def test_a_draft_with_another_vocabulary_is_refused(engines) -> None:
    from types import SimpleNamespace

    from tokenmill.worker.drafter import check_same_vocabulary

    target = engines[0].loaded
    other = SimpleNamespace(
        tokenizer=SimpleNamespace(vocab_size=target.tokenizer.vocab_size, id_to_token=lambda i: f"<{i}>"),
        config=target.config,
        source="other.gguf",
    )
    with pytest.raises(ValueError, match="vocabulary differs"):
        check_same_vocabulary(target, other)  # type: ignore[arg-type]
    check_same_vocabulary(target, target)


@pytest.mark.parametrize(
    ("num_accepted", "num_plain_steps"),
    [(0, 0), (1, 0), (3, 0), (0, 2), (1, 3), (3, 4)],  # a verification's outcome, then steps without drafting
)
def test_the_draft_resumes_from_the_tokens_the_target_kept(
    embedded_loaded, num_accepted, num_plain_steps
) -> None:
    """The draft's KV after a verification and any plain steps (back-off, a wide batch): its rejected drafts'
    positions are computed again, so its next drafts and its KV equal a fresh draft's over the same tokens
    (a prefill of them all). A draft that kept the rejected drafts' KV read 0.64 of its tokens accepted on
    the 1.5B's open-ended prompts instead of 0.82."""
    import torch

    from tokenmill.core.proposers import DRAFT_PLACEHOLDER
    from tokenmill.core.sched_output import ScheduledRow
    from tokenmill.request import Request, RequestStatus
    from tokenmill.worker.drafter import Drafter

    k, block_size, num_blocks = 3, 16, 8
    prompt = embedded_loaded.tokenizer.encode(
        "The lighthouse was built in 1871 from granite quarried inland."
    )
    request = Request("r", prompt, SamplingParams(max_tokens=64))
    request.transition(RequestStatus.RUNNING)
    request.append_output_token(prompt[3], 0.0)  # the prefill's sampled token
    requests = {"r": request}
    drafter = Drafter(embedded_loaded, num_blocks, block_size, requests, p_min=0.0)  # all k slots drafted

    def draft(d: Drafter) -> list[int]:
        row = ScheduledRow(
            "r",
            [request.all_token_ids[-1], *[DRAFT_PLACEHOLDER] * k],
            request.num_tokens - 1,
            list(range(num_blocks)),
            True,
            False,
            num_spec_tokens=k,
        )
        return d.fill([row])[0].spec_token_ids

    drafts = draft(drafter)
    kept = drafts[:num_accepted]  # the target's verification: the accepted drafts, then its own token
    corrected = (
        (drafts[num_accepted] + 1) % embedded_loaded.config.vocab_size if num_accepted < k else prompt[5]
    )
    for token in [*kept, corrected, *prompt[7 : 7 + num_plain_steps]]:
        request.append_output_token(token, 0.0)
    got = draft(drafter)
    fresh = Drafter(embedded_loaded, num_blocks, block_size, requests, p_min=0.0)
    assert got == draft(fresh)
    num_real = (
        request.num_tokens
    )  # positions holding the request's own tokens (after them: this fill's drafts)
    for (k_got, v_got), (k_want, v_want) in zip(drafter.kv_caches, fresh.kv_caches, strict=True):
        for got_cache, want_cache in ((k_got, k_want), (v_got, v_want)):
            got_rows = got_cache.flatten(0, 1)[:num_real]  # [positions, kv_heads, head_dim]
            want_rows = want_cache.flatten(0, 1)[:num_real]
            torch.testing.assert_close(got_rows, want_rows, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("p_min", [0.0, 0.5, 0.9])
def test_the_draft_stops_at_a_token_it_is_unsure_of(embedded_loaded, p_min) -> None:
    """``draft_p_min``: each proposal is the draft's greedy tokens while it gives them ``p_min`` or more, cut
    before the first it does not (``num_spec_tokens`` shortened, 0: nothing to verify); checked against the
    draft model's softmax over a prefill of the request's tokens and the proposal, computed apart."""
    import torch

    from tokenmill.core.proposers import DRAFT_PLACEHOLDER
    from tokenmill.core.sched_output import ScheduledRow
    from tokenmill.model.loader import allocate_kv_cache
    from tokenmill.request import Request, RequestStatus
    from tokenmill.worker.drafter import Drafter
    from tokenmill.worker.forward import forward_rows

    k, block_size, num_blocks = 4, 16, 8
    prompt = embedded_loaded.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    request = Request("r", prompt, SamplingParams(max_tokens=64))
    request.transition(RequestStatus.RUNNING)
    request.append_output_token(prompt[1], 0.0)
    drafter = Drafter(embedded_loaded, num_blocks, block_size, {"r": request}, p_min)
    reference_kv = allocate_kv_cache(
        embedded_loaded.config, num_blocks, block_size, embedded_loaded.dtype, "cpu"
    )
    lengths = []
    for step in range(8):
        slots = [request.all_token_ids[-1], *[DRAFT_PLACEHOLDER] * k]
        row = ScheduledRow("r", slots, request.num_tokens - 1, list(range(num_blocks)), True, False, k)
        (filled,) = drafter.fill([row])
        proposal = filled.spec_token_ids
        assert filled.num_spec_tokens == len(proposal) <= k and filled.token_ids[0] == slots[0]
        context = request.all_token_ids
        with torch.no_grad():
            prefill = ScheduledRow("ref", [*context, *proposal], 0, list(range(num_blocks)), True, True)
            hidden = forward_rows(embedded_loaded.model, [prefill], reference_kv, block_size, "cpu")
            logits = embedded_loaded.model.compute_logits(
                hidden[len(context) - 1 :]
            )  # [len(proposal) + 1, V]
        confidence, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        for i, token in enumerate(proposal):
            assert token == best[i].item() and confidence[i].item() >= p_min - 1e-4, (step, i)
        if len(proposal) < k:
            assert confidence[len(proposal)].item() < p_min + 1e-4, step
        lengths.append(len(proposal))
        for token in [*proposal[:2], (step * 7 + 3) % 100 + 200]:  # the target keeps two, then its own token
            request.append_output_token(token, 0.0)
    if p_min == 0.0:
        assert lengths == [k] * 8
    if p_min == 0.9:
        assert min(lengths) < k  # the 135M is unsure somewhere in this text: the cut is exercised
