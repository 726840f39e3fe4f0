"""A constraint behind a reasoning model's thought, on llguidance's own matcher with the embedded tokenizer: free
text up to ``</think>``, then the constraint; "optional" lets the answer come first."""

from __future__ import annotations

import pytest

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_outputs import StructuredOutputs
from tokenmill.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"n": {"enum": [1, 2, 3]}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(embedded_tokenizer: Tokenizer) -> tuple[StructuredOutputs, Tokenizer]:
    tokenizer = embedded_tokenizer
    return StructuredOutputs(
        tokenizer.to_json(), tokenizer.vocab_size, sorted(tokenizer.eos_token_ids)
    ), tokenizer


def _feed(compiler: tuple[StructuredOutputs, Tokenizer], mode: str | None, text: str) -> str:
    """ "accepting", "open" (valid so far) or "rejected" for ``text`` under the schema after a thought."""
    outputs, tokenizer = compiler
    params = StructuredOutputsParams(json=SCHEMA, after_think=mode)
    matcher = outputs._ll.LLMatcher(outputs.tokenizer, outputs.grammar_text(params), log_level=0)
    for token in tokenizer.encode(text):
        if not matcher.consume_token(token):
            return "rejected"
    return "accepting" if matcher.is_accepting() else "open"


@pytest.mark.parametrize(
    ("mode", "text", "want"),
    [
        (
            "required",
            'Two is the answer, so {"n": 5} is wrong.</think>{"n": 2}',
            "accepting",
        ),  # JSON-like thoughts
        ("required", 'Fine.</think>{"n": 5}', "rejected"),  # the answer is held to the schema
        ("required", '{"n": 2}', "open"),  # still inside the thought: it has not closed
        ("optional", '<think>hmm</think>{"n": 3}', "accepting"),
        ("optional", '{"n": 3}', "accepting"),  # no thought at all
        ("optional", "hello", "rejected"),
        (None, 'Fine.</think>{"n": 2}', "rejected"),  # without it the constraint starts at the first token
    ],
)
def test_the_answer_after_the_thought(compiler: tuple[StructuredOutputs, Tokenizer], mode: str | None,
                                      text: str, want: str) -> None:  # fmt: skip
    assert _feed(compiler, mode, text) == want


def test_the_mode_is_part_of_the_cache_key() -> None:
    keys = {StructuredOutputsParams(json=SCHEMA, after_think=m).key for m in (None, "required", "optional")}
    assert len(keys) == 3
    with pytest.raises(ValueError, match="after_think"):
        StructuredOutputsParams(json=SCHEMA, after_think="always")


def test_think_tags_as_tokens_are_found_and_used() -> None:
    """Where ``<think>`` and ``</think>`` are tokens of their own (Qwen3's tokenizer), llguidance keeps them
    apart from text: the thought is written as "any token but </think>", the tags by id; a Lark constraint
    (a forced tool call's) goes behind it as it is."""
    import json

    from tokenmill.structured_outputs import after_thought, think_tokens

    qwen_like = json.dumps(
        {"added_tokens": [{"id": 7, "content": "<think>"}, {"id": 9, "content": "</think>"}]}
    )
    assert think_tokens(qwen_like) == (7, 9)
    assert think_tokens(json.dumps({"added_tokens": [{"id": 7, "content": "<think>"}]})) is None
    assert think_tokens("not json") is None
    grammar = json.loads(after_thought('start: "x"', "optional", (7, 9)))["grammars"]
    assert grammar[0]["lark_grammar"].startswith("start: (<[7]> thought <[9]>)? @answer")
    assert "thought: <[^9]>*" in grammar[0]["lark_grammar"]
    assert grammar[1] == {"lark_grammar": 'start: "x"', "name": "answer"}
    text = json.loads(after_thought('{"grammars": [{"json_schema": {}}]}', "required"))["grammars"]
    assert text[0]["lark_grammar"].startswith("start: thought @answer") and text[1]["name"] == "answer"
