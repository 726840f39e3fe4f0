"""SamplingParams: every bad field raises ValueError naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tokenmill.sampling_params import SamplingParams

BAD: list[tuple[str, Any]] = [
    ("max_tokens", -3),
    ("max_tokens", 2.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", 2.01),
    ("repetition_penalty", 0.0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_field_raises_naming_it(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_empty_stop_string_raises() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")  # type: ignore[arg-type]


def test_min_tokens_above_max_tokens_raises() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_negative_stop_token_id_raises() -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": -1, "min_p": 0.0},
        {"top_k": 0, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": 1, "min_tokens": 1},
    ],
)
def test_good_values_accepted(kw: dict[str, Any]) -> None:
    SamplingParams(**kw)


def test_greedy_and_normalisation() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy
    assert SamplingParams(stop="x").stop == ["x"]  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # type: ignore[dict-item]
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert not SamplingParams().needs_penalties
