"""A constraint behind a reasoning model's thought, on llguidance's own matcher with the embedded tokenizer: free
text up to ``</think>``, then the constraint; "optional" lets the answer come first."""

from __future__ import annotations

import pytest

from tokenmill.model.embedded import embedded_model_path
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
def compiler() -> tuple[StructuredOutputs, Tokenizer]:
    tokenizer = Tokenizer.from_gguf(embedded_model_path())
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
