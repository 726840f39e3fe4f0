"""The sampling defaults a request gets for the fields it does not set: the model's own, as vLLM's
``--generation-config auto`` reads them, else tokenmill's documented ones. Pure Python, no torch.

``generation_config.json`` in a model directory gives ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``); ``do_sample: false`` there means greedy, as
transformers reads it (temperature 0). Its ``eos_token_id`` joins the model's stop ids elsewhere
(``hf_loader.read_hf_config``).

A GGUF carries none of these, nor does a directory without the file; then :data:`FALLBACK` applies: sampled,
in the range llama.cpp (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.0) and ollama
(temperature 0.8, top-k 40, top-p 0.9, repeat penalty 1.1) use, since a small model decoded greedily falls into
loops (the embedded model: "a cache lies, a cache lies, ..."; at temperature 0.8 without the penalty one of three seeds
still looped on it). A request asking for ``temperature=0`` is greedy over the model's own distribution: the
defaults' top-p / top-k / min-p / repetition penalty apply to sampled requests only (:func:`for_request`; vLLM
would apply a generation_config's repetition penalty to greedy requests too). ``generation_config="none"`` turns both off: the fields keep SamplingParams' own
defaults (OpenAI's temperature 1.0), and greedy stays one flag away (``temperature=0``) whatever the mode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# tokenmill's defaults where the model gives none (see the module docstring)
FALLBACK: dict[str, Any] = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
}
# Defaults that shape a sampled choice; a greedy request (temperature 0) takes none of them (see for_request)
SHAPING = ("top_p", "top_k", "min_p", "repetition_penalty")
_FIELDS = {  # generation_config.json key -> SamplingParams field
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
MODES = ("auto", "none")


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> default value, and where they came from (logged at start, shown by /v1/models)."""

    values: dict[str, Any] = field(default_factory=dict)
    source: str = "none"

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items()) or "SamplingParams' own"
        return f"sampling defaults from {self.source}: {shown}"


def for_request(defaults: dict[str, Any], temperature: float | None) -> dict[str, Any]:
    """The defaults that apply to a request whose own temperature is ``temperature`` (None: unset)."""
    effective = defaults.get("temperature", 1.0) if temperature is None else temperature
    if effective == 0:
        return {k: v for k, v in defaults.items() if k not in SHAPING}
    return dict(defaults)


COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat has none: default_max_tokens)


def default_max_tokens(defaults: dict[str, Any], num_prompt_tokens: int, max_model_len: int) -> int:
    """``max_tokens`` for a chat request that sets none: the model's ``max_new_tokens`` within the room the
    context leaves; else that room (OpenAI's: as long as the context allows; at least 1, so that a prompt that
    fills the context is refused as too long)."""
    room = max(max_model_len - num_prompt_tokens, 1)
    return min(defaults["max_tokens"], room) if "max_tokens" in defaults else room


def resolve(mode: str, model_path: str | Path | None) -> GenerationDefaults:
    """The defaults for ``mode`` (``auto``, ``none``, or a directory holding a ``generation_config.json``)."""
    if mode == "none":
        return GenerationDefaults({}, "none (--generation-config none)")
    if mode != "auto":
        path = Path(mode).expanduser()
        if not (path / "generation_config.json").is_file():
            raise ValueError(
                f"generation_config must be 'auto', 'none' or a directory with a generation_config.json, got {mode!r}"
            )
        return GenerationDefaults(read(path / "generation_config.json"), str(path / "generation_config.json"))
    if model_path is not None and Path(model_path).is_dir():
        file = Path(model_path) / "generation_config.json"
        if file.is_file():
            return GenerationDefaults(read(file), str(file))
    return GenerationDefaults(
        dict(FALLBACK), "tokenmill's defaults (the model has no generation_config.json)"
    )


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object (a model directory's configs); ValueError otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def read(path: Path) -> dict[str, Any]:
    """The sampling fields of one ``generation_config.json``; ValueError when it is not a JSON object."""
    data = read_json_object(path)
    values = {ours: data[theirs] for theirs, ours in _FIELDS.items() if data.get(theirs) is not None}
    if data.get("do_sample") is False:
        values["temperature"] = 0.0  # transformers: greedy, whatever temperature says
    return values
