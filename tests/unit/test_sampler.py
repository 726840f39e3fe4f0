"""Sampler: greedy, seeded reproducibility, distribution sanity, penalties, min_tokens, bias, logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.sampler import Sampler, _apply_penalties, compute_prompt_logprobs

EOS = 2


def _req(
    name: str = "r", prompt: list[int] | None = None, output: list[int] | None = None, **params: Any
) -> Request:
    request = Request(name, prompt or [5, 6, 7], SamplingParams(**params), eos_token_ids=frozenset({EOS}))
    request.output_token_ids = list(output or [])
    return request


def _logits(rows: int, vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


def _counts(tokens: list[int], vocab: int) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(vocab)]


def test_empty_batch() -> None:
    assert Sampler()(torch.empty((0, 10)), []) == []


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    out = Sampler()(logits, [_req(str(i), temperature=0.0) for i in range(8)])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()
    assert all(s.logprob is None and s.top_logprobs is None for s in out)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature: float) -> None:
    logits = _logits(16, seed=1)
    out = Sampler(seed=3)(logits, [_req(str(i), temperature=temperature, top_k=1) for i in range(16)])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_unaffected() -> None:
    logits = _logits(6, seed=2)
    requests = [
        _req(str(i), temperature=0.0 if i % 2 == 0 else 1.0, seed=i if i % 3 == 0 else None) for i in range(6)
    ]
    out = Sampler()(logits, requests)
    for i in (0, 2, 4):
        assert out[i].token_id == int(logits[i].argmax())


def test_seeded_rows_ignore_batch_composition() -> None:
    vocab = 5000
    a, b = _logits(1, vocab, seed=10), _logits(1, vocab, seed=11)
    ra = _req("a", temperature=1.0, top_p=0.95, seed=1234, output=[9, 9])
    rb = _req("b", temperature=0.7, min_p=0.01, seed=-7, output=[1])

    def sample(rows: list[tuple[torch.Tensor, Request]], sampler_seed: int) -> dict[str, int]:
        out = Sampler(seed=sampler_seed)(torch.cat([r[0] for r in rows]), [r[1] for r in rows])
        return {r[1].request_id: s.token_id for r, s in zip(rows, out) if r[1].request_id in ("a", "b")}

    others = [
        (_logits(1, vocab, seed=20 + i), _req(f"o{i}", temperature=1.0, top_k=50, presence_penalty=0.5))
        for i in range(5)
    ]
    reference = sample([(a, ra), (b, rb)], 0)
    assert sample([(b, rb), (a, ra)], 1) == reference  # reordered, other engine seed
    assert sample([others[0], (a, ra), *others[1:3], (b, rb)], 2) == reference  # other rows added
    assert sample([(a, ra)], 3)["a"] == reference["a"]  # alone
    assert sample([(b, rb), *others], 4)["b"] == reference["b"]
    for _ in range(3):  # repeated calls (a recompute after preemption samples at the same position)
        assert sample([(a, ra), (b, rb)], 0) == reference


def test_seeded_rows_vary_with_position_and_seed() -> None:
    logits = torch.zeros((1, 1000))  # uniform: every draw is pure noise
    sampler = Sampler()
    by_position = {sampler(logits, [_req(seed=42, output=[0] * n)])[0].token_id for n in range(20)}
    by_seed = {sampler(logits, [_req(seed=s)])[0].token_id for s in range(20)}
    assert len(by_position) > 10 and len(by_seed) > 10


def test_unseeded_rows_use_the_engine_seed() -> None:
    logits = torch.zeros((4, 1000))
    requests = [_req(str(i)) for i in range(4)]
    first = [s.token_id for s in Sampler(seed=5)(logits, requests)]
    assert [s.token_id for s in Sampler(seed=5)(logits, requests)] == first
    assert len(set(first)) > 1  # rows get different noise


def test_samples_follow_the_distribution() -> None:
    probs = [0.5, 0.3, 0.2]
    n = 20000
    logits = torch.tensor(probs).log().expand(n, 3).contiguous()
    out = Sampler(seed=7)(logits, [_req(str(i)) for i in range(n)])
    freq = _counts([s.token_id for s in out], 3)
    assert all(abs(f - p) < 0.015 for f, p in zip(freq, probs)), freq


def test_temperature_sharpens_and_flattens() -> None:
    n = 20000
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(n, 3).contiguous()
    for temperature in (0.5, 2.0):
        expected = torch.softmax(logits[0] / temperature, -1).tolist()
        out = Sampler(seed=8)(logits, [_req(str(i), temperature=temperature) for i in range(n)])
        freq = _counts([s.token_id for s in out], 3)
        assert all(abs(f - p) < 0.015 for f, p in zip(freq, expected)), (temperature, freq, expected)


def test_top_p_excludes_the_tail() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 10000
    logits = torch.tensor(probs).log().expand(n, 4).contiguous()
    out = Sampler(seed=9)(logits, [_req(str(i), top_p=0.75) for i in range(n)])
    freq = _counts([s.token_id for s in out], 4)
    assert freq[2] == freq[3] == 0.0  # 0.5 + 0.3 already covers 0.75
    assert abs(freq[0] - 0.5 / 0.8) < 0.02


def test_top_k_keeps_the_k_best() -> None:
    n = 5000
    logits = torch.tensor([0.1, 0.4, 0.2, 0.3]).log().expand(n, 4).contiguous()
    out = Sampler(seed=10)(logits, [_req(str(i), top_k=2) for i in range(n)])
    assert {s.token_id for s in out} == {1, 3}


def test_min_p_excludes_unlikely_tokens() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    n = 10000
    logits = torch.tensor(probs).log().expand(n, 4).contiguous()
    out = Sampler(seed=11)(logits, [_req(str(i), min_p=0.2) for i in range(n)])  # threshold 0.1
    freq = _counts([s.token_id for s in out], 4)
    assert freq[3] == 0.0 and freq[2] > 0.1
    assert abs(freq[0] - 0.5 / 0.95) < 0.02


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    penalized = _req(
        "p",
        prompt=[0, 1],
        output=[2, 2, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    plain = _req("q", prompt=[0, 1], output=[2, 2, 3])
    _apply_penalties(logits, [penalized, plain])
    # repetition (prompt+output: 0,1,2,3): 2/2, -1*2, 0.5/2, 3/2; then token 2: -2*0.5 - 0.25, token 3: -0.5 - 0.25
    expected = torch.tensor([[1.0, -2.0, -1.0, 0.75, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    torch.testing.assert_close(logits, expected)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    assert Sampler()(logits, [_req(output=[1], temperature=0.0)])[0].token_id == 1
    assert Sampler()(logits, [_req(output=[1], temperature=0.0, frequency_penalty=1.0)])[0].token_id == 2
    assert Sampler()(logits, [_req(prompt=[1], temperature=0.0, repetition_penalty=1.5)])[0].token_id == 2


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_tokens(ignore_eos: bool) -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])  # EOS (2) then stop token 3 are the favourites
    params = {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": [3], "ignore_eos": ignore_eos}
    assert Sampler()(logits, [_req(output=[0, 0], **params)])[0].token_id == 4
    assert Sampler()(logits, [_req(output=[0, 0, 0], **params)])[0].token_id == EOS
    sampled = Sampler()(
        logits.expand(500, 5),
        [_req(str(i), output=[0], **{**params, "temperature": 1.0}) for i in range(500)],
    )
    assert {s.token_id for s in sampled}.isdisjoint({EOS, 3})


def test_logit_bias_forces_a_token() -> None:
    logits = _logits(50, seed=12)
    requests = [_req(str(i), temperature=1.0, logit_bias={777: 100.0, 10**6: 5.0}) for i in range(50)]
    assert {s.token_id for s in Sampler()(logits, requests)} == {777}
    best = int(logits[0].argmax())
    banned = Sampler()(logits[:1], [_req(temperature=0.0, logit_bias={best: -100.0})])[0].token_id
    assert banned != best


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = _logits(3, vocab=50, seed=13)
    requests = [
        _req("a", temperature=1.0, logprobs=5, logit_bias={3: 100.0}, repetition_penalty=1.7),
        _req("b", temperature=0.0),
        _req("c", temperature=0.0, logprobs=0),
    ]
    out = Sampler()(logits, requests)
    raw = torch.log_softmax(logits, -1)
    assert out[0].token_id == 3
    assert out[0].logprob == pytest.approx(raw[0, 3].item(), abs=1e-5)
    values, ids = raw[0].topk(5)
    assert [t for t, _ in out[0].top_logprobs or []] == ids.tolist()
    assert [v for _, v in out[0].top_logprobs or []] == pytest.approx(values.tolist(), abs=1e-5)
    assert out[1].logprob is None and out[1].top_logprobs is None
    assert out[2].logprob == pytest.approx(raw[2].max().item(), abs=1e-5) and out[2].top_logprobs == []


def test_compute_prompt_logprobs() -> None:
    logits = _logits(4, vocab=30, seed=14)
    targets = [3, 0, 29, 7]
    result = compute_prompt_logprobs(logits, targets, k=2)
    raw = torch.log_softmax(logits, -1)
    assert [r.token_id for r in result] == targets
    for i, r in enumerate(result):
        assert r.logprob == pytest.approx(raw[i, targets[i]].item(), abs=1e-5)
        assert [t for t, _ in r.top_logprobs] == raw[i].topk(2).indices.tolist()
        assert math.isclose(sum(math.exp(v) for v in raw[i].tolist()), 1.0, rel_tol=1e-4)
    assert compute_prompt_logprobs(logits, torch.tensor(targets), k=0)[1].top_logprobs == []


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(RuntimeError, match="2 requests"):
        Sampler()(torch.zeros((3, 10)), [_req("a"), _req("b")])


def _reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The distribution after temperature, top_k, top_p and min_p, in float64 and by hand (sort, cut, renorm)."""
    x = logits.double() / temperature
    order = x.argsort(descending=True)
    probs = torch.softmax(x[order][:top_k], dim=0)  # top_k
    keep = (probs.cumsum(0) - probs) < top_p  # top_p: the mass before a token must be under top_p
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    probs = torch.where(probs >= min_p * probs[0], probs, 0.0)  # min_p against the best
    out = torch.zeros_like(x)
    out[order[:top_k]] = probs / probs.sum()
    return out


@pytest.mark.slow  # 12 s of draws
def test_top_k_rows_draw_from_the_float64_distribution() -> None:
    """Rows with a small top_k draw among their top_k candidates only, the others over the vocabulary: the
    frequencies of 30,000 draws match the distribution computed in float64 (chi-square, 0.1% level), for several
    settings, seeded and unseeded."""
    vocab = 2000
    logits = _logits(1, vocab, seed=3)[0] / 2
    for temperature, top_k, top_p, min_p, seeded in ((0.7, 8, 1.0, 0.0, False), (1.3, 20, 0.9, 0.0, True),
                                                     (1.0, 40, 0.95, 0.05, False), (0.5, 0, 0.8, 0.0, True),
                                                     (0.6, 0, 1.0, 0.02, False)):  # fmt: skip
        # top_k 0: the whole vocabulary (the sorted path), the others their top_k candidates
        expected = _reference(logits, temperature, top_k or vocab, top_p, min_p)
        n = 30000
        requests = [
            _req(str(i), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                 seed=i if seeded else None)
            for i in range(n)
        ]  # fmt: skip
        out = Sampler(seed=1)(logits.expand(n, vocab).contiguous(), requests)
        counts = torch.bincount(torch.tensor([s.token_id for s in out]), minlength=vocab).double()
        support = expected > 0
        assert counts[~support].sum() == 0  # nothing outside what the filters keep
        e = expected[support] * n
        chi2 = float(((counts[support] - e) ** 2 / e).sum())
        dof = int(support.sum()) - 1
        # 0.1% critical value of chi-square, Wilson-Hilferty approximation
        z = 3.09
        critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < critical, (temperature, top_k, top_p, min_p, chi2, critical)


def test_a_seeded_top_k_row_ignores_the_batch() -> None:
    vocab = 3000
    a = _logits(1, vocab, seed=30)
    ra = _req("a", temperature=0.9, top_k=40, top_p=0.95, seed=77, output=[3])
    alone = Sampler(seed=0)(a, [ra])[0].token_id
    wide = _req("w", temperature=1.0, seed=5)  # no top_k: the whole vocabulary
    wider_k = _req("k", temperature=1.0, top_k=500)  # unseeded, a larger top_k
    for others in ([wide], [wider_k], [wide, wider_k]):
        batch = torch.cat([a, *[_logits(1, vocab, seed=31 + i) for i in range(len(others))]])
        assert Sampler(seed=9)(batch, [ra, *others])[0].token_id == alone
