"""The Llama hyperparameters, read from a Hugging Face ``config.json`` or from GGUF metadata.

Pure Python. Anything tokenmill cannot run (another architecture, biases, an unknown RoPE variant) is
refused here with a ``ValueError`` that names it, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None, {"rope_type": "linear", "factor"} or {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # GGUF only: llama.cpp stores llama3-style RoPE scaling as one divisor per frequency
    # (the ``rope_freqs`` tensor), [head_dim // 2] values; applied on top of rope_scaling.
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        _check_rope_scaling(self.rope_scaling)
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors must have head_dim // 2 = {self.head_dim // 2} values, "
                f"got {len(self.rope_freq_factors)}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from the parsed ``config.json`` of a Hugging Face checkpoint (transformers 4.x or 5.x)."""
        _check_hf_architecture(d)
        missing = [key for key in _REQUIRED_HF_KEYS if d.get(key) is None]
        if missing:
            raise ValueError(f"config.json is missing required key(s): {', '.join(missing)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"unsupported config: {key}=true (tokenmill's Llama has no biases)")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_theta, rope_scaling = _hf_rope(d)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: dict[str, Any],
        *,
        vocab_size: int,
        tie_word_embeddings: bool,
        rope_freq_factors: tuple[float, ...] | None = None,
    ) -> LlamaConfig:
        """Build from GGUF key/value metadata (scalars only) plus facts read off the tensors.

        ``vocab_size`` is the row count of ``token_embd``; ``tie_word_embeddings`` is whether the file
        lacks an ``output`` tensor; ``rope_freq_factors`` is the ``rope_freqs`` tensor when present.
        """
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")

        def need(key: str) -> Any:
            if f"llama.{key}" not in meta:
                raise ValueError(f"GGUF metadata is missing llama.{key}")
            return meta[f"llama.{key}"]

        hidden_size = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        num_kv_heads = int(meta.get("llama.attention.head_count_kv", num_heads))
        head_dim = int(meta.get("llama.attention.key_length", hidden_size // num_heads))
        rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ValueError(
                f"partial rotary embeddings are not supported (rope dims {rope_dim}, head_dim {head_dim})"
            )
        eos_keys = (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        eos = [meta.get(key) for key in eos_keys]
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(meta),
            max_position_embeddings=int(meta.get("llama.context_length", 2048)),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            rope_freq_factors=rope_freq_factors,
        )


def _check_hf_architecture(d: dict[str, Any]) -> None:
    model_type = d.get("model_type")
    architectures = d.get("architectures") or []
    if model_type == "llama" or (model_type is None and "LlamaForCausalLM" in architectures):
        return
    # A Mistral checkpoint without sliding-window attention is a Llama under another name.
    if model_type == "mistral" and d.get("sliding_window") is None:
        return
    what = f"model_type {model_type!r}" + (f" (architectures {architectures})" if architectures else "")
    if model_type == "mistral":
        what += " with sliding_window attention"
    raise ValueError(f"unsupported architecture: {what}; tokenmill runs Llama models (LlamaForCausalLM)")


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from transformers 5 ``rope_parameters`` or 4.x keys."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), _normalize_rope_scaling(params)
    return float(d.get("rope_theta", 10000.0)), _normalize_rope_scaling(d.get("rope_scaling"))


def _normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        out: dict[str, Any] = {"rope_type": "linear", "factor": float(scaling["factor"])}
    elif rope_type == "llama3":
        missing = [key for key in _LLAMA3_KEYS if key not in scaling]
        if missing:
            raise ValueError(f"llama3 rope_scaling is missing {', '.join(missing)}")
        out = {"rope_type": "llama3", **{key: scaling[key] for key in _LLAMA3_KEYS}}
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}: supported are 'llama3' and 'linear'")
    _check_rope_scaling(out)
    return out


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ("linear", "llama3"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}: supported are 'llama3' and 'linear'")
    if not scaling.get("factor", 0) > 0:
        raise ValueError(f"rope_scaling factor must be positive, got {scaling.get('factor')!r}")
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if not 0 < low < high or scaling["original_max_position_embeddings"] < 1:
            raise ValueError(
                f"invalid llama3 rope_scaling {scaling}: need 0 < low_freq_factor < high_freq_factor"
            )


def _gguf_rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    rope_type = meta.get("llama.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    raise ValueError(f"unsupported GGUF rope scaling type {rope_type!r}: supported are 'none' and 'linear'")


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
