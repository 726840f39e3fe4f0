"""Text <-> token ids, and chat prompts, for a model loaded from a GGUF file or a Hugging Face directory.

A thin owner around a ``tokenizers.Tokenizer`` (the Rust BPE): it knows which ids are special, which end
generation, whether the model wants a BOS token, and how to render the model's chat template. Pure Python
plus ``tokenizers`` and ``jinja2``: no torch.

From a GGUF file the BPE is rebuilt from ``tokenizer.ggml.*`` metadata::

    model "gpt2": tokens, merges -> BPE model (byte-level, as GPT-2)
    model "llama": tokens, scores -> SentencePiece BPE with byte fallback (merges ranked by score)
    token_type 3 / 4       -> added tokens: special (control) / text matched whole (user-defined)
    tokenizer.ggml.pre     -> pre-tokenizer split rule (see _PRE_TOKENIZER_RULES)
    add_bos/add_eos_token  -> a post-processor adding them
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer

# the GGUF keys whose tokens end a generation
GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split rules applied before the byte-level mapping, by ``tokenizer.ggml.pre``.
_GPT2_RULE = "gpt2"  # the GPT-2 regex inside ByteLevel
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = "digits+gpt2"  # every digit on its own, then the GPT-2 regex
_PRE_TOKENIZER_RULES: dict[str, str] = {
    "gpt2": _GPT2_RULE,
    "gpt-2": _GPT2_RULE,
    "default": _GPT2_RULE,
    "llama-bpe": _LLAMA3_PATTERN,
    "llama3": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
}


class Tokenizer:
    """Encode, decode and chat-template for one model. Build it with :meth:`from_gguf` or :meth:`from_hf_dir`."""

    def __init__(
        self,
        backend: _RustTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
        add_bos_token: bool = False,
        extra_special_token_ids: Iterable[int] = (),
    ) -> None:
        """``add_bos_token`` prepends BOS in :meth:`encode` when ``backend``'s post-processor does not already."""
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special.update(extra_special_token_ids)
        special.update(self.eos_token_ids)
        if bos_token_id is not None:
            special.add(bos_token_id)
        self.special_token_ids = frozenset(special)
        self._prepend_bos = add_bos_token and bos_token_id is not None and not self._backend_adds_bos()

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild the tokenizer stored in a GGUF file's ``tokenizer.*`` metadata."""
        import gguf  # heavy-ish import, only needed here

        return cls.from_gguf_reader(gguf.GGUFReader(str(path)), source=str(path))

    @classmethod
    def from_gguf_reader(cls, reader: Any, source: str = "<gguf>") -> Tokenizer:
        """As :meth:`from_gguf`, from an already-open ``gguf.GGUFReader`` (the weight loader can share one)."""
        meta = _GGUFMetadata(reader)
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(
                f"{source}: tokenizer model {model!r} is not supported; 'gpt2' (byte-level BPE) and 'llama' "
                "(SentencePiece BPE) are"
            )
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(f"{source}: {len(token_types)} token types for {len(tokens)} tokens")

        vocab = _first_ids(tokens, source)
        backend = (
            _byte_level_backend(meta, vocab, source)
            if model == "gpt2"
            else _sentencepiece_backend(meta, tokens, vocab, source)
        )
        # Control tokens (<|im_start|>) are special: matched whole, dropped from decoded text. User-defined ones
        # (Qwen's <tool_call>) are matched whole too but are text, as llama.cpp renders them and as the model's
        # own tokenizer.json marks them (special: false): a tool-call parser and a grammar both see "<tool_call>".
        added = [
            AddedToken(tokens[i], special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
            for i, kind in enumerate(token_types)
            if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) and vocab.get(tokens[i]) == i
        ]
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        _add_bos_eos(backend, meta, tokens, model == "llama")
        eos_ids = {meta.get(key) for key in GGUF_EOS_KEYS}
        extra_special = {
            meta.get("tokenizer.ggml.unknown_token_id"),
            meta.get("tokenizer.ggml.padding_token_id"),
        }
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids={i for i in eos_ids if i is not None},
            chat_template=meta.get("tokenizer.chat_template"),
            extra_special_token_ids={i for i in extra_special if i is not None},
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json``, ``chat_template.jinja`` and
        ``generation_config.json`` when present, from a Hugging Face model directory."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(
                f"{root}: no tokenizer.json (only fast, tokenizers-format tokenizers are supported)"
            )
        backend = _RustTokenizer.from_file(str(tokenizer_file))
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")

        def token_id(key: str) -> int | None:
            content = _token_content(config.get(key))
            return None if content is None else backend.token_to_id(content)

        bos_id = token_id("bos_token")
        eos_ids: set[int] = set()
        for candidate in (token_id("eos_token"), generation.get("eos_token_id")):
            if isinstance(candidate, int):
                eos_ids.add(candidate)
            elif isinstance(candidate, list):
                eos_ids.update(int(i) for i in candidate)
        extra_special = {token_id("unk_token"), token_id("pad_token")}

        chat_template: str | None = None
        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(config.get("chat_template"))
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=chat_template,
            add_bos_token=bool(config.get("add_bos_token", False)),
            extra_special_token_ids={i for i in extra_special if i is not None},
        )

    def disable_truncation_and_padding(self) -> None:
        """Drop the truncation and padding a ``tokenizer.json`` may carry (BERT's pad every input to 128)."""
        self._backend.no_truncation()
        self._backend.no_padding()

    # --- tokens -------------------------------------------------------------------------------
    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (special or not) whose text is exactly ``text``, else None: Qwen's
        ``<tool_call>`` is one token, which a grammar must name as that token (llguidance sees added tokens as
        tokens, never as the bytes of their text)."""
        for token_id, token in self._backend.get_added_tokens_decoder().items():
            if token.content == text:
                return int(token_id)
        return None

    def to_json(self) -> str:
        """The backend tokenizer as Hugging Face ``tokenizer.json`` text (what llguidance reads)."""
        return str(self._backend.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; with ``add_special_tokens`` adds BOS (or EOS) only where the model's tokenizer does."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of ``token_id`` (byte-level form, e.g. ``"Ġworld"``)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return str(token)

    def token_to_id(self, token: str) -> int | None:
        """The id of a raw vocabulary string, or None when it is not one."""
        token_id = self._backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The primary EOS string (the lowest of ``eos_token_ids``), for chat templates."""
        return self.id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else None

    # --- chat ---------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template, as Hugging Face's ``tokenize=False`` does."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain-text prompt instead")
        _check_messages(messages)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        if tools is not None:
            variables["tools"] = tools
        try:
            return self._compiled_template.render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template does anything with ``tools`` (Hugging Face templates that support them)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Template then encode; the BOS a template writes itself is not doubled. ``template_kwargs``: more
        variables for the template (``enable_thinking``...)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **(template_kwargs or {})
        )
        ids = self.encode(text)
        bos = self.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            del ids[0]
        return ids

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the model's chat template does not parse: {e}") from e

    def _backend_adds_bos(self) -> bool:
        ids = self._backend.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={sorted(self.eos_token_ids)}, chat_template={self.chat_template is not None})"
        )


# --- GGUF helpers -----------------------------------------------------------------------------
class _GGUFMetadata:
    """Key -> Python value over a ``gguf.GGUFReader``'s fields."""

    def __init__(self, reader: Any) -> None:
        self._fields: Mapping[str, Any] = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"GGUF metadata has no {key!r}: the file carries no usable tokenizer")
        return self.get(key)


def _split_merge(merge: str, source: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ValueError(f"{source}: malformed BPE merge {merge!r}")
    return left, right


def _first_ids(tokens: list[str], source: str) -> dict[str, int]:
    """token -> id; some converted vocabularies repeat a string, and the first id wins."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            logger.warning("%s: token %r repeated at ids %d and %d", source, tok, vocab[tok], i)
            continue
        vocab[tok] = i
    return vocab


def _byte_level_backend(meta: Any, vocab: dict[str, int], source: str) -> Any:
    """GPT-2 style byte-level BPE from the GGUF's merges and pre-tokenizer name."""
    merges: list[str] = meta.require("tokenizer.ggml.merges")
    merge_pairs = [_split_merge(m, source) for m in merges]
    backend = _RustTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default", source)
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_bos_eos(backend: Any, meta: Any, tokens: list[str], sentencepiece: bool) -> None:
    """BOS / EOS added around every encoding as the file says; llama.cpp adds BOS to a SentencePiece vocabulary
    that does not say otherwise (older files have no flag)."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        backend.post_processor = _bos_eos_processor(
            (tokens[bos_id], bos_id) if add_bos else None, (tokens[eos_id], eos_id) if add_eos else None
        )


def _sentencepiece_backend(
    meta: Any, tokens: list[str], vocab: dict[str, int], source: str
) -> _RustTokenizer:
    """A GGUF ``llama`` vocabulary (SentencePiece BPE: pieces with scores, ``▁`` for a space, ``<0xNN>`` byte
    pieces) as a ``tokenizers`` BPE with byte fallback, spelled the way transformers' ``LlamaTokenizer`` reads
    it: a ``▁`` prepended to the first word and spaces as ``▁``.

    The file rarely lists merges; then they come from the scores, as SentencePiece's BPE applies them: every split
    of a piece into two pieces of the vocabulary is a merge ranked by the whole piece's score (higher first;
    ties: longer left part, longer right part, the piece's id, the parts' ids).
    """
    merges_field = meta.get("tokenizer.ggml.merges")
    if merges_field:
        merges = [_split_merge(m, source) for m in merges_field]
    else:
        scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise ValueError(f"{source}: {len(scores)} scores for {len(tokens)} tokens")
        ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
        for piece, index in vocab.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    key = (-scores[index], -len(left), -len(right), index, vocab[left], vocab[right])
                    ranked.append((*key, left, right))
        ranked.sort()
        merges = [(left, right) for *_, left, right in ranked]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = _RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    arch = meta.get("general.architecture")
    if (
        arch == "phi3"
    ):  # Phi-3's tokenizer.json: the prefix and spaces from a normalizer (differs on leading spaces)
        steps = [normalizers.Replace(pattern=" ", content="▁")]
        backend.normalizer = normalizers.Sequence(
            ([normalizers.Prepend(prepend="▁")] if add_prefix else []) + steps
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
        )
    steps_out = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps_out.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps_out)
    return backend


def _gguf_pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    rule = _PRE_TOKENIZER_RULES.get(pre)
    if rule is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; splitting words as GPT-2 does", source, pre)
        rule = _GPT2_RULE
    byte_level_with_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == _GPT2_RULE:
        return byte_level_with_regex
    if rule == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_with_regex])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rule), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bos_eos_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    prefix = [bos[0]] if bos else []
    suffix = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=[*prefix, "$A", *suffix],
        pair=[*prefix, "$A", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=[t for t in (bos, eos) if t is not None],
    )


# --- HF directory helpers ---------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A token in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_chat_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of {"name", "template"} of which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    raise ValueError(
        f"chat_template must be a string or a list of named templates, got {type(value).__name__}"
    )


# --- chat template helpers --------------------------------------------------------------------
def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {message!r}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] needs a 'role' string")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise ValueError(f"messages[{i}] ({role}) needs a 'content' string")


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # Unlike jinja's built-in, no HTML escaping: the output is a prompt, not a web page.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


__all__ = ["Tokenizer"]
