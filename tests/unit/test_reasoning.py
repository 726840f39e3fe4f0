"""The reasoning parsers against recorded outputs and vLLM's rules, whole and streamed in pieces cut anywhere
(every cut point, and random chunkings): the streamed pieces always add up to the whole text's split."""

from __future__ import annotations

import random

import pytest

from tokenmill.reasoning import StreamSplit, prompt_opens_reasoning, split

# (parser, output, opened in the prompt, reasoning, answer)
CASES = [
    # Qwen3 thinking: the tags in the output
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", False,
     "The user greets me.", "Hello! How can I help?"),
    # Qwen3 with enable_thinking false: an empty think block, or none at all
    ("qwen3", "<think>\n\n</think>\n\nParis.", False, "", "Paris."),
    ("qwen3", "Paris is the capital.", False, None, "Paris is the capital."),
    ("qwen3", "  x < y and <think> later", False, None, "  x < y and <think> later"),
    # Qwen3's thinking-only templates open the tag in the prompt
    ("qwen3", "Counting r's: three.\n</think>\n\nThree.", True, "Counting r's: three.", "Three."),
    # cut by max_tokens inside the reasoning
    ("qwen3", "<think>\nStep 1: add 2 and", False, "Step 1: add 2 and", ""),
    # DeepSeek-R1 distills: the opening tag in the prompt, or in the output
    ("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", False, "Okay, 2+2 is 4.", "The answer is 4."),
    ("deepseek_r1", "<think>\nHmm.\n</think>\nYes.", False, "Hmm.", "Yes."),
    ("deepseek_r1", "Still thinking about", False, "Still thinking about", ""),  # never closed: all reasoning
    ("deepseek_r1", "a </thin b </think> c </think> d", False, "a </thin b", "c </think> d"),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "opened", "reasoning", "content"), CASES)
def test_whole_output(parser: str, text: str, opened: bool, reasoning: str | None, content: str) -> None:
    got = split(parser, text, opened)
    assert (got.reasoning, got.content) == (reasoning, content)


def _streamed(parser: str, pieces: list[str], opened: bool) -> tuple[str, str, bool]:
    stream = StreamSplit(parser, opened)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.feed("", final=True)
    return reasoning + r, content + c, stream.thought


@pytest.mark.parametrize(("parser", "text", "opened", "reasoning", "content"), CASES)
def test_streamed_in_any_pieces(
    parser: str, text: str, opened: bool, reasoning: str | None, content: str
) -> None:
    want = (reasoning or "", content, reasoning is not None)
    for cut in range(len(text) + 1):  # every single cut point, a tag split anywhere
        assert _streamed(parser, [text[:cut], text[cut:]], opened) == want, cut
    rng = random.Random(len(text))
    for _ in range(50):  # random chunkings, a character at a time among them
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _streamed(parser, pieces, opened) == want, pieces


def test_nothing_is_taken_back() -> None:
    """What a piece emits never changes: a partial tag is held, not sent and later retracted."""
    stream = StreamSplit("qwen3")
    assert stream.feed("<thi") == ("", "")  # it may open a thought: nothing goes out
    assert stream.feed("nk>Let me see") == ("Let me see", "")
    assert stream.feed(" now</th") == (" now", "")  # "</th" held: it may close the thought
    assert stream.feed("ink>\n\nDone") == ("", "Done")
    assert stream.feed(" here.") == ("", " here.")
    assert stream.feed("", final=True) == ("", "")


def test_the_prompt_opening_the_tag() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="reasoning parser"):
        StreamSplit("granite")
