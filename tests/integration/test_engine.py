"""The engine end to end on the embedded model, pinned against transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "Caches make computers fast because",
]
NUM_TOKENS = 12


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def hf_reference(hf_embedded):
    """Greedy continuations by transformers' generate, each prompt alone (no padding involved)."""
    model, tok = hf_embedded
    refs = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=NUM_TOKENS, do_sample=False, min_new_tokens=NUM_TOKENS)
            refs[prompt] = (ids[0].tolist(), out[0, ids.shape[1] :].tolist())
    return refs


def test_batched_greedy_equals_transformers(make_engine, hf_reference):
    engine = make_engine()
    outs = engine.generate(PROMPTS, greedy(NUM_TOKENS))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref_prompt_ids, ref_tokens = hf_reference[prompt]
        assert out.prompt_token_ids == ref_prompt_ids
        assert out.outputs[0].token_ids == ref_tokens, prompt
        assert out.outputs[0].finish_reason == "length"
    engine.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks


def test_each_prompt_alone_equals_batch(make_engine):
    engine = make_engine()
    batch = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy(NUM_TOKENS))]
    alone = [engine.generate([p], greedy(NUM_TOKENS))[0].outputs[0].token_ids for p in PROMPTS]
    assert batch == alone


def test_chunked_prefill_equals_whole_prefill(make_engine):
    long_prompt = " ".join(["tokens flow through the mill"] * 20)
    whole = make_engine().generate([long_prompt], greedy(8))[0].outputs[0].token_ids
    chunked_engine = make_engine(max_num_batched_tokens=16)
    chunked = chunked_engine.generate([long_prompt], greedy(8))[0].outputs[0].token_ids
    assert chunked == whole
    assert chunked_engine.stats.num_iterations > 8  # the prompt took several chunks


def _seed_workload():
    # The seed's shape: 8 requests, 5-token prompts, seven wanting 4 tokens and one wanting 32.
    prompts = [[100 + 7 * i + j for j in range(5)] for i in range(8)]
    params = [greedy(4)] * 7 + [greedy(32)]
    return prompts, params


@pytest.mark.parametrize("block_size,num_kv_blocks", [(2, 20), (2, 24)])
def test_forced_preemption_keeps_greedy_tokens(make_engine, block_size, num_kv_blocks):
    prompts, params = _seed_workload()
    free = make_engine(max_num_seqs=8, block_size=16, num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    assert free.stats.num_preemptions == 0
    assert free.stats.num_iterations == 32 and free.stats.num_token_slots == 60

    tight = make_engine(max_num_seqs=8, block_size=block_size, num_kv_blocks=num_kv_blocks)
    streamed: dict[str, list[int]] = {}
    ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finished = {}
    while tight.has_unfinished():
        result = tight.step()
        tight.check_integrity()
        for delta in result.deltas:
            streamed.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        for out in result.finished:
            assert out.request_id not in finished, "a request finished twice"
            finished[out.request_id] = out
    assert tight.stats.num_preemptions > 0
    assert tight.stats.num_recomputed_tokens > 0
    for rid, want in zip(ids, expected, strict=True):
        assert finished[rid].outputs[0].token_ids == want
        assert streamed[rid] == want  # no token duplicated or dropped in the stream
    assert tight.num_free_blocks == tight.num_total_blocks


def test_longer_workload_under_pressure(make_engine):
    prompts = [[200 + 3 * i + j for j in range(8 + 5 * i)] for i in range(8)]
    params = [greedy(8 + 3 * i) for i in range(8)]
    expected = [o.outputs[0].token_ids for o in make_engine(num_kv_blocks=256).generate(prompts, params)]
    tight = make_engine(block_size=8, num_kv_blocks=14, max_num_seqs=6)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.stats.num_preemptions > 0
    assert got == expected
    tight.check_integrity()
    assert tight.num_free_blocks == tight.num_total_blocks


def test_abort_waiting_running_and_preempted(make_engine):
    engine = make_engine(max_num_seqs=2, block_size=4, num_kv_blocks=6)
    a = engine.add_request([11, 12, 13, 14, 15], greedy(12))
    b = engine.add_request([21, 22, 23, 24, 25], greedy(12))
    c = engine.add_request([31, 32, 33], greedy(4))  # waits behind max_num_seqs=2
    preempted = None
    ends: dict[str, int] = {}
    for _ in range(40):
        result = engine.step()
        engine.check_integrity()
        for out in result.finished:
            ends[out.request_id] = ends.get(out.request_id, 0) + 1
        if result.record.preempted_ids and preempted is None:
            preempted = result.record.preempted_ids[0]
            assert engine.abort(preempted)
            break
    assert preempted is not None, "the pool was meant to force a preemption"
    waiting = c if c not in ends else None
    running = next(r for r in (a, b) if r != preempted)
    if waiting is not None:
        assert engine.abort(waiting)
    engine.abort(running)
    while engine.has_unfinished():
        for out in engine.step().finished:
            ends[out.request_id] = ends.get(out.request_id, 0) + 1
    assert set(ends) == {a, b, c}
    assert all(n == 1 for n in ends.values())
    assert not engine.abort(a)  # already ended: nothing to do
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_value_error(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", greedy(4))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request([1, 2, 10**7], greedy(4))
    with pytest.raises(ValueError, match="max_model_len|64"):
        engine.add_request(list(range(100, 160)), greedy(10))
    assert not engine.has_unfinished()
    # A refused request never blocks the queue: the next one runs.
    assert engine.generate(["Hello"], greedy(3))[0].outputs[0].finish_reason == "length"


def test_stop_string_and_stop_token(make_engine):
    engine = make_engine()
    base = engine.generate(["1, 2, 3, 4,"], greedy(16))[0].outputs[0]
    assert "7" in base.text
    stopped = engine.generate(["1, 2, 3, 4,"], greedy(16, stop=["7"]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "7"
    assert stopped.text == base.text[: base.text.index("7")]
    tok_stop = base.token_ids[3]
    by_token = engine.generate(["1, 2, 3, 4,"], greedy(16, stop_token_ids=[tok_stop]))[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == tok_stop
    assert by_token.token_ids == base.token_ids[: base.token_ids.index(tok_stop) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_engine):
    engine = make_engine()
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate(["Tell me a story"], sp)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    mixed = engine.generate(["Hi", "Tell me a story", "Why is the sky blue?"], [others, sp, others])
    assert mixed[1].outputs[0].token_ids == alone


def test_stats_and_idle_reasons(make_engine):
    engine = make_engine(max_num_seqs=8)
    prompts, params = _seed_workload()
    engine.generate(prompts, params)
    stats = engine.stats
    assert stats.num_collected_tokens == 60
    assert stats.occupancy == pytest.approx(60 / (8 * 32))
    assert stats.idle_rows_by_reason["queue_empty"] == 8 * 32 - 60


def test_pool_sized_from_a_memory_budget(embedded_loaded):
    from tokenmill.engine import Engine
    from tokenmill.model.loader import kv_bytes_per_block

    per_block = kv_bytes_per_block(embedded_loaded.config, 16, embedded_loaded.dtype)
    # 30 layers x (K + V) x 16 tokens x 3 KV heads x 64 dims x 4 bytes
    assert per_block == 30 * 2 * 16 * 3 * 64 * 4
    engine = Engine(loaded=embedded_loaded, device="cpu", kv_cache_memory_bytes=37 * per_block + 5)
    assert engine.num_total_blocks == 37
    assert engine.kv_cache_bytes == 37 * per_block
    # Without a budget: a fraction of free memory, capped at what max_num_seqs full-length rows could use.
    capped = Engine(loaded=embedded_loaded, device="cpu", max_num_seqs=2, max_model_len=256)
    assert capped.num_total_blocks == 2 * 256 // 16
    with pytest.raises(ValueError, match="holds no block"):
        Engine(loaded=embedded_loaded, device="cpu", kv_cache_memory_bytes=per_block - 1)


def test_prompt_logprobs_complete_after_preemption(make_engine):
    """Chunked prefills under a tight pool: a request preempted (mid-prefill or later) still gets one entry per
    prompt token, equal to the unpreempted engine's."""
    prompts = [[200 + 3 * i + j for j in range(8 + 5 * i)] for i in range(8)]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, prompt_logprobs=1) for i in range(8)]
    free = make_engine(num_kv_blocks=256).generate(prompts, params)
    tight_engine = make_engine(block_size=8, num_kv_blocks=14, max_num_seqs=6, max_num_batched_tokens=8)
    tight = tight_engine.generate(prompts, params)
    preempted = [o for o in tight if o.metrics.num_preemptions > 0]
    assert preempted, "the pool was meant to force preemptions"
    for want, got, prompt in zip(free, tight, prompts, strict=True):
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(prompt)
        assert got.prompt_logprobs[0] is None
        # chunks of 8 go through the few-rows kernel (x times the codes, scaled per group), whole prompts through
        # the expanded-weights one: the same values rounded differently, 1e-4 relative on a -20 logprob
        for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
            assert b.token_id == a.token_id and b.logprob == pytest.approx(a.logprob, rel=3e-4, abs=1e-4)
    assert tight_engine.num_free_blocks == tight_engine.num_total_blocks


def test_a_prompt_arriving_during_a_thread_probe_runs_on_every_thread(make_engine):
    """The thread governor trials one thread fewer on decode steps; a prefill step in the middle of the trial runs
    at the chosen count (all threads on a quiet machine), decode steps at the trial's. Two threads whatever an
    earlier engine's governor left set (the count is process-wide; the conftest restores it after)."""
    torch.set_num_threads(2)
    engine = make_engine(max_num_seqs=4)
    governor = engine.thread_governor
    assert governor is not None and governor.max_threads == 2
    seen: list[tuple[bool, int]] = []  # (the step has a prompt's tokens, threads during its forward)
    execute = engine.runner.execute

    def recording(scheduler_output):
        seen.append((any(r.is_prefill for r in scheduler_output.rows), torch.get_num_threads()))
        return execute(scheduler_output)

    engine.runner.execute = recording
    engine.add_request("Once upon a time", greedy(8))
    engine.step()  # the first request's prefill
    governor._start_probe()
    engine.step()  # a decode step under the probe
    engine.add_request("def fibonacci(n):", greedy(4))
    engine.step()  # the second prompt joins: a mixed step
    engine.step()  # decode again
    assert seen[1:] == [(False, 1), (True, 2), (False, 1)]


def test_a_probe_ends_with_the_work_and_a_later_engine_starts_at_every_thread(make_engine):
    """A governor's probe lowers torch's process-wide count, and a run can end in the middle of one: the engine out
    of work ends it, and a later engine in the process starts at the count of the first, not at what an earlier
    governor left (a second engine built after one left at one thread would have had nothing to govern)."""
    from tokenmill.engine import _process_num_threads

    every = _process_num_threads()
    if every < 2:
        pytest.skip("one thread: nothing to govern")
    engine = make_engine(max_num_seqs=4)
    engine.add_request("Once upon a time", greedy(4))
    engine.step()
    engine.thread_governor._start_probe()
    assert torch.get_num_threads() == every - 1
    while engine.has_unfinished():
        engine.step()
    assert torch.get_num_threads() == every and engine.thread_governor._probing is None
    torch.set_num_threads(1)  # as a governor beside a busy neighbour leaves it
    later = make_engine()
    assert torch.get_num_threads() == every and later.thread_governor.max_threads == every


def test_two_engines_in_one_process_each_run_at_their_own_count(make_engine):
    """torch's thread count is the process's: one engine's governor that chose one thread must not leave the other
    engine's forwards at one thread while that one's governor believes it set two (a benchmark holds both)."""
    from tokenmill.engine import _process_num_threads

    if _process_num_threads() < 2:
        pytest.skip("one thread: nothing to govern")
    torch.set_num_threads(2)
    lowered, other = make_engine(max_num_seqs=4), make_engine(max_num_seqs=4)
    seen: dict[str, list[int]] = {"lowered": [], "other": []}
    for name, engine in (("lowered", lowered), ("other", other)):
        execute = engine.runner.execute

        def recording(scheduler_output, execute=execute, name=name):
            seen[name].append(torch.get_num_threads())
            return execute(scheduler_output)

        engine.runner.execute = recording
    for governor in (lowered.thread_governor, other.thread_governor):
        # no probe of the governors' own: a busy host's counters would start one at once, and this test is about
        # the counts each engine sets, not the counts a governor picks
        governor._load, governor.probe_every, governor.collapse_steps = None, 10**9, 10**9
    lowered.thread_governor.num_threads = 1  # as a governor leaves it after a probe that one thread won
    lowered.thread_governor._apply(1)
    assert torch.get_num_threads() == 1 and other.thread_governor.applied == 2
    other.add_request("Once upon a time", greedy(4))
    lowered.add_request("def fibonacci(n):", greedy(4))
    while other.has_unfinished() or lowered.has_unfinished():
        other.step()
        lowered.step()
    assert seen["other"] and set(seen["other"]) == {2}
    assert seen["lowered"] and set(seen["lowered"]) == {1}
