"""The pydantic protocol models and their mapping onto SamplingParams."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tokenmill.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatStreamChoice,
    CompletionRequest,
    ParamError,
    parse_logit_bias,
    to_sampling_params,
    validation_error_to_param,
)


@pytest.mark.parametrize(
    "prompt",
    ["hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]],
)
def test_completion_prompt_shapes(prompt: object) -> None:
    req = CompletionRequest.model_validate({"prompt": prompt})
    assert req.prompt == prompt
    assert req.max_tokens == 16


@pytest.mark.parametrize("field", ["tools", "audio", "frobnicate"])
def test_unknown_fields_are_refused_by_name(field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", field: 3})
    param = validation_error_to_param(info.value)
    assert param.param == field and "not permitted" in param.message


def test_nulls_mean_default() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": None, "n": None, "stream": None})
    assert req.num_choices == 1
    params = to_sampling_params(req, max_tokens=4, logprobs=None)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.max_tokens == 4


def test_vllm_extras_reach_sampling_params() -> None:
    req = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [7],
            "skip_special_tokens": False,
            "stop": "END",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"42": 5},
        }
    )
    p = to_sampling_params(req, max_tokens=8, logprobs=3, seed=11)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (5, 0.1, 1.2, 2)
    assert p.ignore_eos and not p.skip_special_tokens
    assert p.stop == ["END"] and p.stop_token_ids == [7]
    assert p.logit_bias == {42: 5.0} and p.logprobs == 3 and p.seed == 11
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", -1, "temperature"),
        ("top_p", 0, "top_p"),
        ("presence_penalty", 3, "presence_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("stop", [""], "stop"),
        ("min_tokens", 99, "min_tokens"),
    ],
)
def test_bad_values_name_their_param(field: str, value: object, param: str) -> None:
    req = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(ParamError) as info:
        to_sampling_params(req, max_tokens=4, logprobs=None)
    assert info.value.param == param


def test_bad_logprobs_name_the_request_field() -> None:
    req = CompletionRequest.model_validate({"prompt": "x"})
    with pytest.raises(ParamError) as info:
        to_sampling_params(req, max_tokens=4, logprobs=50)
    assert info.value.param == "logprobs"
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ParamError) as info:
        to_sampling_params(chat, max_tokens=4, logprobs=50, chat=True)
    assert info.value.param == "top_logprobs"
    with pytest.raises(ParamError) as info:
        to_sampling_params(chat, max_tokens=-1, logprobs=None, chat=True)
    assert info.value.param == "max_tokens"


def test_n_is_bounded() -> None:
    with pytest.raises(ParamError) as info:
        _ = CompletionRequest.model_validate({"prompt": "x", "n": 0}).num_choices
    assert info.value.param == "n"


def test_logit_bias_keys_must_be_ids() -> None:
    assert parse_logit_bias({"3": -100}) == {3: -100.0}
    with pytest.raises(ParamError) as info:
        parse_logit_bias({"hello": 1})
    assert info.value.param == "logit_bias"


def test_validation_error_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "many"})
    err = validation_error_to_param(info.value)
    assert err.param == "max_tokens"
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({})
    assert validation_error_to_param(info.value).param == "prompt"
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"content": "hi"}]})
    assert validation_error_to_param(info.value).param == "messages.0.role"


def test_chat_messages_and_token_limits() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
    ]
    assert req.max_completion_tokens == 5 and req.logprobs and req.top_logprobs == 2
    with pytest.raises(ParamError) as info:
        ChatCompletionRequest.model_validate({"messages": []}).template_messages()
    assert info.value.param == "messages"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(ParamError):
        ChatCompletionRequest.model_validate({"messages": [image]}).template_messages()


def test_chat_delta_sends_only_what_is_set() -> None:
    first = ChatStreamChoice(index=0, delta=ChatDelta(role="assistant", content=""))
    later = ChatStreamChoice(index=1, delta=ChatDelta(content="hi"), finish_reason="stop")
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[first, later])
    body = json.loads(chunk.model_dump_json(exclude={"usage"}))
    assert body["object"] == "chat.completion.chunk"
    assert body["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert body["choices"][1]["delta"] == {"content": "hi"}
    assert body["choices"][1]["finish_reason"] == "stop"
    assert "usage" not in body
