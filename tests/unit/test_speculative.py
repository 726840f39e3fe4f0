"""Speculative decoding's parts without a model: the config, the n-gram proposer, the sampler's verification
(greedy and rejection sampling, checked against float64 softmax with a chi-square test) and the KV trim."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.proposers import DRAFT_PLACEHOLDER, DraftSlots, NgramProposer
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import Sampler

# --- config ---------------------------------------------------------------------------------------


def test_config_parses_vllm_dicts() -> None:
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4
    )
    # one end given alone moves the other when it must (vLLM sets both)
    assert SpeculativeConfig.parse({"prompt_lookup_min": 6}) == SpeculativeConfig(
        prompt_lookup_min=6, prompt_lookup_max=6
    )
    assert SpeculativeConfig.parse({"prompt_lookup_max": 1}) == SpeculativeConfig(
        prompt_lookup_min=1, prompt_lookup_max=1
    )
    assert SpeculativeConfig.parse({"disable_by_batch_size": 0}).disable_by_batch_size == 0
    draft = {"method": "draft_model", "model": "m", "quantization": "gguf-q8"}
    assert SpeculativeConfig.parse(draft).quantization == "gguf-q8"  # vLLM's key for the draft's quantization
    assert SpeculativeConfig.parse({**draft, "draft_p_min": 0}).draft_p_min == 0  # 0: always all k slots
    assert SpeculativeConfig.parse({**draft, "draft_p_min": 0.75}).draft_p_min == 0.75
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"num_lookahead": 2}, "unknown key"),
        ({"disable_by_batch_size": -1}, "disable_by_batch_size"),
        ({"model": "x"}, "only for method 'draft_model'"),
        ({"quantization": "gguf-q4"}, "quantization is only for method 'draft_model'"),
        ({"method": "draft_model", "model": "x", "quantization": "int4"}, "quantization must be one of"),
        ({"draft_p_min": 0.5}, "draft_p_min is only for method 'draft_model'"),
        (
            {"method": "draft_model", "model": "x", "draft_p_min": 1.0},
            r"draft_p_min must be a number in \[0, 1\)",
        ),
        ({"method": "draft_model", "model": "x", "draft_p_min": -0.1}, "draft_p_min must be"),
        ({"method": "draft_model", "model": "x", "draft_p_min": "high"}, "draft_p_min must be"),
        ({"method": "draft_model", "model": "x", "draft_p_min": True}, "draft_p_min must be"),
        ("ngram", "must be a dict"),
    ],
)
def test_config_refuses_what_it_does_not_do(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


# --- the n-gram proposer ----------------------------------------------------------------------------


def _request(prompt: list[int], output: list[int] = (), **params: Any) -> Request:  # type: ignore[assignment]
    r = Request("r", list(prompt), SamplingParams(**params))
    r.output_token_ids = list(output)
    return r


def test_ngram_proposes_what_followed_the_longest_earlier_match() -> None:
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    )
    # suffix [7, 8, 9] occurred at 1..3 followed by 10, 11, 12; [8, 9] alone also at 6..7 followed by 99
    r = _request([1, 7, 8, 9, 10, 11, 12, 8, 9, 99, 5], [7, 8, 9])
    assert proposer.propose(r, 10) == [10, 11, 12]
    assert proposer.propose(r, 2) == [10, 11]  # capped by the scheduler's room
    assert proposer.propose(r, 0) == []


def test_ngram_prefers_the_most_recent_occurrence_and_respects_min() -> None:
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=2)
    )
    r = _request([4, 5, 1, 2, 4, 5, 3, 6], [4, 5])
    assert proposer.propose(r, 5) == [3, 6]  # the later [4, 5] is followed by 3, 6
    lone = _request([1, 2, 3, 9], [3])  # only a 1-gram repeats: below prompt_lookup_min
    assert NgramProposer(SpeculativeConfig(prompt_lookup_min=2)).propose(lone, 5) == []


def test_ngram_index_grows_with_the_output() -> None:
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    )
    r = _request([10, 11, 12, 13, 14, 15])
    assert proposer.propose(r, 4) == []
    r.output_token_ids.extend([10, 11])  # the answer starts copying the prompt
    assert proposer.propose(r, 4) == [12, 13, 14, 15]
    r.output_token_ids.extend([12, 13, 14, 15, 10, 11, 12])  # and repeats: the latest occurrence wins
    assert proposer.propose(r, 4) == [13, 14, 15, 10]


def test_ngram_backs_off_after_rejections_and_resets_on_acceptance() -> None:
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1)
    )
    r = _request([3, 4, 3])
    assert proposer.propose(r, 2) == [4, 3]
    proposer.observe("r", 2, 0)  # rejected outright: 2 steps without proposals
    assert [proposer.propose(r, 2) for _ in range(3)] == [[], [], [4, 3]]
    proposer.observe("r", 2, 0)  # twice in a row: 4 steps
    assert [proposer.propose(r, 2) for _ in range(5)] == [[], [], [], [], [4, 3]]
    proposer.observe("r", 2, 1)  # half accepted ends the back-off
    assert proposer.propose(r, 2) == [4, 3]
    proposer.observe("r", 2, 1)
    four = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
    )
    r4 = _request([3, 4, 5, 6, 7, 3])
    assert four.propose(r4, 4) == [4, 5, 6, 7]
    four.observe("r", 4, 1)  # 1 of 4: not worth its verification
    assert four.propose(r4, 4) == []
    proposer.forget("r")
    assert proposer._state == {}


def test_ngram_cuts_a_proposal_at_what_the_grammar_refuses() -> None:
    class Grammar:
        def validate_tokens(self, tokens: list[int]) -> int:
            return tokens.index(99) if 99 in tokens else len(tokens)

    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=1)
    )
    r = _request([5, 6, 99, 7, 5])
    r.grammar = Grammar()
    assert proposer.propose(r, 4) == [6]


# --- verification -------------------------------------------------------------------------------


def _seq(name: str, output: list[int] = (), **params: Any) -> Request:  # type: ignore[assignment]
    r = Request(name, [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({0}))
    r.output_token_ids = list(output)
    return r


def test_greedy_verification_keeps_the_argmax_chain() -> None:
    vocab = 8
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([4, 5, 2, 7]):  # the target's argmax at each of 4 positions
        logits[row, best] = 5.0
    sampler = Sampler()
    r = _seq("a", [3], temperature=0.0)
    assert [t.token_id for t in sampler.verify(logits, [r], [[4, 5, 2]])[0]] == [4, 5, 2, 7]  # all + bonus
    assert [t.token_id for t in sampler.verify(logits, [r], [[4, 6, 2]])[0]] == [4, 5]  # cut at the mismatch
    assert [t.token_id for t in sampler.verify(logits, [r], [[1, 5, 2]])[0]] == [4]
    assert [t.token_id for t in sampler.verify(logits[:1], [r], [[]])[0]] == [4]


def test_verification_applies_each_positions_processing() -> None:
    """Position j sees the proposed tokens before it: a repetition penalty counts them, min_tokens too, and
    logprobs are the raw distribution's at each emitted token's own position."""
    vocab = 8
    logits = torch.zeros((3, vocab))
    logits[:, 6] = 2.0  # 6 is best everywhere, 5 a close second
    logits[:, 5] = 1.9
    r = _seq("a", [1], temperature=0.0, repetition_penalty=2.0, logprobs=2)
    out = Sampler().verify(logits, [r], [[6, 6]])[0]
    # position 1 has 6 in its output so far: penalised to 1.0 < 1.9, so 5 wins there and the second 6 is cut
    assert [t.token_id for t in out] == [6, 5]
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out[0].logprob == pytest.approx(float(raw[0, 6]), abs=1e-5)
    assert out[1].logprob == pytest.approx(float(raw[1, 5]), abs=1e-5)
    assert [tok for tok, _ in out[1].top_logprobs] == [6, 5]
    eos_late = _seq("b", [], temperature=0.0, min_tokens=2)
    logits = torch.zeros((3, vocab))
    logits[:, 0] = 9.0  # EOS is the argmax, but not before two tokens
    logits[:, 3] = 1.0
    assert [t.token_id for t in Sampler().verify(logits, [eos_late], [[3, 3]])[0]] == [3, 3, 0]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True) if p > 0)


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}])
def test_rejection_sampling_draws_the_targets_distribution(params: dict[str, Any]) -> None:
    """The first emitted token, and the second one when the first proposal was accepted, are distributed as the
    target's own distributions at those positions (float64 softmax of the processed logits), whatever the
    proposal: a likely one, an unlikely one, one the target excludes."""
    vocab = 6
    gen = torch.Generator().manual_seed(0)
    base = torch.randn((2, vocab), generator=gen, dtype=torch.float64)  # positions 0 and 1
    temperature = params["temperature"]

    def target(row: int) -> list[float]:
        x = base[row] / temperature
        if "top_k" in params:
            keep = x.topk(params["top_k"]).indices
            x = torch.full_like(x, -math.inf).scatter(0, keep, x[keep])
        return torch.softmax(x, dim=-1).tolist()

    p0, p1 = target(0), target(1)
    sampler = Sampler(seed=1)
    n = 6000
    for proposal in (int(torch.tensor(p0).argmax()), int(torch.tensor(p0).argmin())):
        requests = [_seq(f"r{i}", [5], **params) for i in range(n)]
        logits = base.float().repeat(n, 1)  # each request's two positions
        outs = sampler.verify(logits, requests, [[proposal] for _ in range(n)])
        first = [0] * vocab
        second = [0] * vocab
        for out in outs:
            first[out[0].token_id] += 1
            if len(out) == 2:
                assert out[0].token_id == proposal
                second[out[1].token_id] += 1
        # df <= 5: P(chi2 > 25) < 2e-4
        assert _chi_square(first, p0) < 25, (first, p0)
        if sum(second) > 500:
            assert _chi_square(second, p1) < 25, (second, p1)
        if p0[proposal] == 0:
            assert first[proposal] == 0


def test_seeded_verification_is_reproducible() -> None:
    logits = torch.randn((3, 50), generator=torch.Generator().manual_seed(3))
    draws = [
        [
            t.token_id
            for t in Sampler(seed=s).verify(logits, [_seq("a", [1], temperature=1.0, seed=7)], [[4, 9]])[0]
        ]
        for s in (0, 1)
    ]
    assert draws[0] == draws[1]  # the request's seed decides, not the engine's


# --- the KV trim --------------------------------------------------------------------------------


@pytest.mark.parametrize("reserve", ["none", "worst_case"])
def test_trim_gives_back_the_rejected_tokens_blocks(reserve: str) -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=10), reserve, enable_caching=True)  # type: ignore[arg-type]
    r = Request("r", list(range(6)), SamplingParams(max_tokens=20))
    assert kv.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    r.output_token_ids = [50]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(r, 1 + 5) is not None  # the last token and 5 proposed: slots 6..11
    assert len(r.block_ids) == 3
    r.output_token_ids += [51]  # one proposed token accepted, plus the bonus token
    r.num_computed_tokens = 8
    assert kv.trim_to(r, r.num_computed_tokens + 1) == 0  # slot 8 is in block 2: nothing wholly past it
    r.num_computed_tokens = 7
    assert kv.trim_to(r, 8) == 1
    assert len(r.block_ids) == 2 and kv.num_free_blocks == free_before
    kv.check_integrity()
    kv.free(r)
    assert kv.num_free_blocks == 10


@pytest.mark.parametrize(
    ("disable_by_batch_size", "num_requests", "speculates"), [(4, 3, True), (4, 4, False), (0, 6, True)]
)
def test_wide_batches_decode_plainly(disable_by_batch_size: int, num_requests: int, speculates: bool) -> None:
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=64))
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
        kv,
        4,
        NgramProposer(SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=disable_by_batch_size)),
    )
    for i in range(num_requests):
        sched.add_request(Request(f"r{i}", [5, 6, 7, 5], SamplingParams(max_tokens=8)))
    sched.schedule()  # the prefills
    for r in sched.running:
        r.advance(r.num_tokens)
        r.append_output_token(6, 0.0)  # [5, 6, 7, 5, 6]: "5 6" occurred before, followed by 7 5
    rows = sched.schedule().rows
    assert [row.num_spec_tokens > 0 for row in rows] == [speculates] * num_requests


def test_draft_slots_start_late_only_when_worth_the_catch_up() -> None:
    config = SpeculativeConfig(
        method="draft_model", model="d", num_speculative_tokens=3, disable_by_batch_size=4
    )
    slots = DraftSlots(config)
    fresh = _request([1, 2, 3], [4], max_tokens=50)
    assert slots.propose(fresh, 10, num_running=1) == [DRAFT_PLACEHOLDER] * 3
    assert slots.propose(fresh, 10, num_running=4) == []  # too wide a batch
    assert slots.propose(fresh, 10, num_running=1) == [DRAFT_PLACEHOLDER] * 3  # it had drafted: resumes
    late = _request(list(range(40)), [4], max_tokens=30)
    late.request_id = "late"
    assert slots.propose(late, 10, num_running=5) == []
    assert slots.propose(late, 10, num_running=1) == []  # 29 tokens to go < 41 the draft would first read
    long_run = _request(list(range(10)), [4], max_tokens=100)
    long_run.request_id = "long"
    assert slots.propose(long_run, 10, num_running=5) == []
    assert slots.propose(long_run, 10, num_running=1) == [DRAFT_PLACEHOLDER] * 3


def test_empty_drafts_back_off_two_to_a_miss() -> None:
    """A draft model that leaves its slots empty (unsure of its first token) spent a forward for nothing: two such
    proposals in a row back off as one rejected proposal does; a good proposal between them resets the count."""
    config = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=3)
    slots = DraftSlots(config)
    r = _request([1, 2, 3], [4], max_tokens=100)
    draft = [DRAFT_PLACEHOLDER] * 3
    assert slots.propose(r, 10) == draft
    slots.observe("r", 0, 0)  # one empty draft: no back-off yet
    assert slots.propose(r, 10) == draft
    slots.observe("r", 3, 2)  # a good proposal in between starts the count again
    assert slots.propose(r, 10) == draft
    slots.observe("r", 0, 0)
    assert slots.propose(r, 10) == draft
    slots.observe("r", 0, 0)  # two in a row: a miss, 2 steps off
    assert [slots.propose(r, 10) for _ in range(3)] == [[], [], draft]
    slots.observe("r", 3, 0)  # then a rejected proposal: the second miss in a row, 4 steps off
    assert [slots.propose(r, 10) for _ in range(5)] == [[], [], [], [], draft]


@pytest.mark.parametrize("num_drafted", [0, 1, 2])
def test_a_draft_that_stopped_short_counts_only_its_tokens(num_drafted: int) -> None:
    """The runner says how many of a row's 3 slots the draft filled (``num_drafted``): the counts, the decode
    tokens and the back-off see those; the tokens verified after them are appended; the blocks the unused slots
    took go back (a row left empty is a plain decode row, its token in ``sampled``)."""
    from tokenmill.core.sched_output import ModelRunnerOutput, SampledToken

    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=16))
    config = SpeculativeConfig(
        method="draft_model", model="d", num_speculative_tokens=3, disable_by_batch_size=0
    )
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        kv,
        4,
        DraftSlots(config),
    )
    r = Request("r", [5, 6, 7], SamplingParams(max_tokens=20))
    sched.add_request(r)
    out = sched.schedule()  # the prefill
    sched.update_from_output(out, ModelRunnerOutput(sampled={"r": SampledToken(8)}), 0.0)
    out = sched.schedule()
    (row,) = out.rows
    assert row.num_spec_tokens == 3 and row.start_position == 3 and len(r.block_ids) == 2  # slots 3..6
    assert out.record.num_decode_tokens == 4
    drafted = [9, 10][:num_drafted]
    if num_drafted:
        result = ModelRunnerOutput(
            sampled={},
            verified={"r": [SampledToken(t) for t in [*drafted, 11]]},
            num_drafted={"r": num_drafted},
        )
    else:
        result = ModelRunnerOutput(sampled={"r": SampledToken(11)}, num_drafted={"r": 0})
    sched.update_from_output(out, result, 0.0)
    assert r.output_token_ids == [8, *drafted, 11]
    assert r.num_computed_tokens == 4 + num_drafted
    assert out.record.num_decode_tokens == 1 + num_drafted
    assert (out.record.num_spec_drafts, out.record.num_spec_draft_tokens) == (
        int(num_drafted > 0),
        num_drafted,
    )
    assert out.record.num_spec_accepted_tokens == num_drafted
    assert (r.num_spec_drafts, r.num_spec_draft_tokens) == (int(num_drafted > 0), num_drafted)
    assert len(r.block_ids) == 2  # the next row's slot (position 4 + num_drafted) is in block 1
    kv.check_integrity()
    with pytest.raises(RuntimeError, match="drafted 4 tokens"):  # more than the row's slots: a broken runner
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(sampled={}, num_drafted={"r": 4}), 0.0)


def test_ngram_bound_replays_the_proposer_on_known_outputs() -> None:
    """benchmarks/spec.py's bound on prompt lookup (verification free), counted by hand: the output copies the
    prompt's run 1 2 3 4 5 and then leaves it."""
    from benchmarks.spec import ngram_bound

    prompt, output = [7, 1, 2, 3, 4, 5, 8], [1, 2, 3, 4, 5, 6]
    # t=0, t=1: no suffix of 2+ tokens seen before; t=2: "1 2" proposes 3 4 5 8, three accepted, and the
    # target's own token ends the output: 6 tokens in 3 steps
    assert ngram_bound([prompt], [output], 4) == (6, 3, 1)
    # k = 2: t=2 proposes 3 4 (both accepted); t=5: "2 3 4 5" proposes 8, rejected
    assert ngram_bound([prompt], [output], 2) == (6, 4, 2)


def test_method_none_turns_speculation_off_and_auto_waits_for_the_model() -> None:
    from tokenmill.config import SPECULATION_AUTO, EngineConfig

    assert EngineConfig(speculative_config={"method": "none"}).speculative_config is None
    with pytest.raises(ValueError, match="takes no other keys"):
        EngineConfig(speculative_config={"method": "none", "num_speculative_tokens": 2})
    assert EngineConfig(speculative_config=SPECULATION_AUTO).speculative_config == SPECULATION_AUTO
    with pytest.raises(ValueError, match="must be a dict or 'auto'"):
        EngineConfig(speculative_config="ngram")


def test_the_cli_default_is_auto_and_json_none_is_off() -> None:
    import argparse

    from tokenmill.config import SPECULATION_AUTO
    from tokenmill.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).speculative_config == SPECULATION_AUTO
    off = parser.parse_args(["--speculative-config", '{"method": "none"}'])
    assert engine_config_from_args(off).speculative_config is None
