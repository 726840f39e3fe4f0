"""The decoder's hyperparameters, read from a Hugging Face ``config.json`` or from GGUF metadata.

One decoder (``llama.py``) runs every family below; a family is a set of these fields, not a copy of the model:

=========  ======================================================================================
family     differs from Llama in
=========  ======================================================================================
llama      (``attention_bias`` puts a bias on q, k, v and o)
mistral    ``sliding_window`` on every layer (when set)
qwen2      a bias on q, k and v; a sliding window on layers >= ``max_window_layers`` when asked
qwen3      RMSNorm of each head's q and k before RoPE (``qk_norm``), ``head_dim`` of its own, optional bias
phi3       q/k/v and gate/up fused in the checkpoint; ``partial_rotary_factor``; ``sliding_window``
gemma3     (text) embeddings scaled by sqrt(hidden) (``embed_scale``); RMSNorm weights meaning 1 + w
           (``norm_offset``); four norms a layer, after attention and around the MLP (``sandwich_norms``);
           q/k norms; GeGLU with tanh GELU (``hidden_act``); sliding-window (local) layers with a RoPE base
           of their own (``rope_local_theta``) between global ones; queries scaled by
           ``query_pre_attn_scalar ** -0.5`` (``attention_scale``); head_dim 256
=========  ======================================================================================

Pure Python. Anything tokenmill cannot run (another architecture, MoE layers, an MLP bias, an unknown RoPE
variant) is refused here with a ``ValueError`` that names it, before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.tokenizer import GGUF_EOS_KEYS

_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN's keys besides factor and original_max_position_embeddings, each None when absent (model/llama.py's
# defaults: transformers' and the paper's)
_YARN_OPTIONAL_KEYS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
_ROPE_TYPES = "'linear', 'llama3' and 'yarn'"
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPES = {"gemma3_text": "gemma3"}  # a config.json's model_type -> family, where the two differ
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Gemma 3 (transformers' Gemma3TextConfig): every 6th layer global, the others local with this RoPE base
_GEMMA3_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_LAYER_TYPES = ("full_attention", "sliding_attention")


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
    model_type: str = "llama"  # one of FAMILIES
    qkv_bias: bool = False  # a bias on the q, k and v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on the output projection (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head before RoPE (Qwen3)
    rotary_dim: int | None = None  # the leading dims of a head that RoPE rotates (None: all of head_dim)
    sliding_window: int | None = None  # a key is visible when query_pos - window < key_pos <= query_pos
    sliding_window_layers: tuple[int, ...] | None = None  # the layers with the window (None: every layer)
    hidden_act: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with tanh GELU)
    embed_scale: float | None = None  # the embedding lookup multiplied by this (Gemma: sqrt(hidden_size))
    norm_offset: float = 0.0  # a checkpoint's RMSNorm weight w scales by norm_offset + w (Gemma: 1 + w)
    sandwich_norms: bool = False  # a norm after attention's output and around the MLP: four a layer (Gemma 3)
    attention_scale: float | None = None  # scores scaled by this (None: head_dim ** -0.5)
    rope_local_theta: float | None = (
        None  # RoPE base of the sliding-window layers, unscaled (None: rope_theta)
    )

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
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type must be one of {', '.join(FAMILIES)}, got {self.model_type!r}")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise ValueError(
                f"rope_freq_factors must have rotary dims / 2 = {self.rope_dim // 2} values, "
                f"got {len(self.rope_freq_factors)}"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window!r}"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got {self.hidden_act!r}")
        if self.sliding_window_layers is not None and any(
            not 0 <= i < self.num_hidden_layers for i in self.sliding_window_layers
        ):
            raise ValueError(
                f"sliding_window_layers {self.sliding_window_layers} name layers that do not exist"
            )

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def layer_rope_local(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates with the local RoPE base (a sliding-window layer of Gemma 3)."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from the parsed ``config.json`` of a Hugging Face checkpoint (transformers 4.x or 5.x)."""
        family = _hf_family(d)
        missing = [key for key in _REQUIRED_HF_KEYS if d.get(key) is None]
        if missing:
            raise ValueError(f"config.json is missing required key(s): {', '.join(missing)}")
        act = d.get("hidden_act") or d.get("hidden_activation") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {act!r}: supported are 'silu' (SwiGLU) and 'gelu_pytorch_tanh' (GeGLU)"
            )
        if d.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=true (tokenmill's MLP has no biases)")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope_theta, rope_scaling = _hf_rope(d)
        params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        rotary_dim = int(head_dim * partial)
        attention_bias = bool(d.get("attention_bias", False))
        if family == "qwen2":
            qkv_bias, o_bias = True, False  # Qwen2's q/k/v always carry a bias, its o_proj never
        elif family in ("llama", "qwen3"):
            qkv_bias = o_bias = attention_bias
        else:
            if attention_bias:
                raise ValueError(f"unsupported config: attention_bias=true for model_type {family!r}")
            qkv_bias = o_bias = False
        window, window_layers = _hf_sliding_window(d, family)
        gemma = _hf_gemma3_fields(d, head_dim) if family == "gemma3" else {}
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
            max_position_embeddings=_scaled_context(d.get("max_position_embeddings", 2048), rope_scaling),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family == "gemma3")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            model_type=family,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=family in ("qwen3", "gemma3"),
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            sliding_window=window,
            sliding_window_layers=window_layers,
            hidden_act=_ACTIVATIONS[act],
            **gemma,
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: dict[str, Any],
        *,
        vocab_size: int,
        tie_word_embeddings: bool,
        rope_freq_factors: tuple[float, ...] | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
    ) -> LlamaConfig:
        """Build from GGUF key/value metadata (scalars only) plus facts read off the tensors.

        ``vocab_size`` is the row count of ``token_embd``; ``tie_word_embeddings`` is whether the file
        lacks an ``output`` tensor; ``rope_freq_factors`` is the ``rope_freqs`` tensor when present;
        ``qkv_bias`` / ``qk_norm`` whether the file has ``attn_q.bias`` / ``attn_q_norm`` tensors.
        """
        arch = _gguf_architecture(meta)
        need = _gguf_required(meta, arch)
        hidden_size = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", hidden_size // num_heads))
        rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        eos = [meta.get(key) for key in GGUF_EOS_KEYS]
        window = meta.get(f"{arch}.attention.sliding_window")
        num_layers = int(need("block_count"))
        gemma = (
            _gguf_gemma3_fields(meta, hidden_size, num_heads, head_dim, num_layers)
            if arch == "gemma3"
            else {}
        )
        gguf_scaling = _gguf_rope_scaling(meta, arch)
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=gguf_scaling,
            max_position_embeddings=_scaled_context(
                int(meta.get(f"{arch}.context_length", 2048)), gguf_scaling
            ),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            rope_freq_factors=rope_freq_factors,
            model_type=_GGUF_ARCHITECTURES[arch],
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rotary_dim=None if rope_dim == head_dim else rope_dim,
            sliding_window=int(window) if window else None,
            **gemma,
        )


def _gguf_required(meta: dict[str, Any], arch: str) -> Callable[[str], Any]:
    """A reader of the architecture's keys that names a missing one (ValueError)."""

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return meta[f"{arch}.{key}"]

    return need


_GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma3": "gemma3",
}


def _gguf_gemma3_fields(
    meta: dict[str, Any], hidden_size: int, num_heads: int, head_dim: int, num_layers: int
) -> dict[str, Any]:
    """Gemma 3's fields, as llama.cpp reads its GGUF: a window on every layer but each sixth (or every
    ``sliding_window_pattern``-th), the local RoPE base ``rope.freq_base_swa`` (10,000 when absent), queries
    scaled by head_dim ** -0.5 (hidden / heads for the 62-layer 27B, whose query_pre_attn_scalar is that). The
    norms' weights are stored as 1 + w: ``norm_offset`` says what they mean, and the GGUF reader subtracts it to
    give Hugging Face's values."""
    if meta.get("gemma3.final_logit_softcapping"):
        raise ValueError(
            f"unsupported GGUF: final_logit_softcapping={meta['gemma3.final_logit_softcapping']}"
        )
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_WINDOW_PATTERN))
    scalar = hidden_size // num_heads if num_layers == 62 else head_dim
    return {
        "hidden_act": "gelu_tanh",
        "embed_scale": float(hidden_size) ** 0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "attention_scale": float(scalar) ** -0.5,
        "rope_local_theta": float(meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_THETA)),
        "sliding_window_layers": tuple(
            i for i in range(num_layers) if pattern == 0 or i % pattern < pattern - 1
        ),
    }


def _gguf_architecture(meta: dict[str, Any]) -> str:
    """``general.architecture``, refused unless it is a family of the one decoder (and not MoE)."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: supported are {', '.join(_GGUF_ARCHITECTURES)}"
        )
    if meta.get(f"{arch}.expert_count"):
        raise ValueError(f"unsupported GGUF: MoE layers ({arch}.expert_count={meta[f'{arch}.expert_count']})")
    return str(arch)


def _hf_gemma3_fields(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """What Gemma 3 (text) adds to the decoder, as transformers' Gemma3TextConfig reads it."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            raise ValueError(f"unsupported config: {key}={d[key]} (Gemma 2's soft-capping)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("unsupported config: use_bidirectional_attention=true (an encoder, not a decoder)")
    params = d.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    local_theta = (local or {}).get("rope_theta", d.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
    return {
        "embed_scale": float(d["hidden_size"]) ** 0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "attention_scale": float(d.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        "rope_local_theta": float(local_theta),
    }


def _hf_family(d: dict[str, Any]) -> str:
    """The family of a ``config.json``: its ``model_type`` (or its architecture's), MoE refused."""
    model_type = _MODEL_TYPES.get(d.get("model_type"), d.get("model_type"))  # type: ignore[arg-type]
    architectures = d.get("architectures") or []
    if model_type is None:
        model_type = next((_ARCHITECTURES[a] for a in architectures if a in _ARCHITECTURES), None)
    moe = [key for key in _MOE_KEYS if d.get(key)]
    if moe:
        raise ValueError(f"unsupported config: MoE layers ({', '.join(f'{k}={d[k]}' for k in moe)})")
    if model_type not in FAMILIES:
        what = f"model_type {model_type!r}" + (f" (architectures {architectures})" if architectures else "")
        raise ValueError(
            f"unsupported architecture: {what}; tokenmill runs {', '.join(FAMILIES)} "
            f"({', '.join(_ARCHITECTURES)})"
        )
    return str(model_type)


def _hf_sliding_window(d: dict[str, Any], family: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers it applies to: None for every layer) as transformers reads each family's config."""
    num_layers = int(d["num_hidden_layers"])
    window = d.get("sliding_window")
    if family in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        window = None
    if family == "llama" or not window:
        return None, None
    layer_types = d.get("layer_types")
    if layer_types is None and family == "gemma3":
        pattern = int(d.get("sliding_window_pattern", _GEMMA3_WINDOW_PATTERN))
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}: supported are {', '.join(_LAYER_TYPES)}")
        layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif family in ("qwen2", "qwen3"):
        first = int(d.get("max_window_layers", num_layers))
        layers = tuple(range(first, num_layers))
    else:
        layers = tuple(range(num_layers))
    return (int(window), layers) if layers else (None, None)


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from transformers 5 ``rope_parameters`` or 4.x keys; a
    ``rope_scaling`` entry wins over ``rope_parameters``' type, as transformers reads it."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if isinstance(params, dict) and isinstance(
        params.get("full_attention"), dict
    ):  # per layer type (Gemma 3)
        params = params["full_attention"]
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"]), _normalize_rope_scaling(
            scaling or params, d.get("max_position_embeddings")
        )
    return float(d.get("rope_theta", 10000.0)), _normalize_rope_scaling(
        scaling, d.get("max_position_embeddings")
    )


def _scaled_context(max_position_embeddings: int, rope_scaling: dict[str, Any] | None) -> int:
    """The positions a model takes: YaRN's original context times its factor where that is more (Qwen2.5's 128k
    configuration keeps max_position_embeddings at 32,768 and adds factor 4; vLLM derives the length so too)."""
    if rope_scaling is None or rope_scaling["rope_type"] != "yarn":
        return int(max_position_embeddings)
    scaled = int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"])
    return max(int(max_position_embeddings), scaled)


def _normalize_rope_scaling(
    scaling: dict[str, Any] | None, max_position_embeddings: int | None = None
) -> dict[str, Any] | None:
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
    elif rope_type == "yarn":
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = scaling.get("factor")
        if factor is None and original and max_position_embeddings:  # as transformers infers it
            factor = max_position_embeddings / original
        out = {"rope_type": "yarn", "factor": float(factor or 0), "original_max_position_embeddings": original,
               **{key: scaling.get(key) for key in _YARN_OPTIONAL_KEYS}}  # fmt: skip
    else:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}: supported are {_ROPE_TYPES}")
    _check_rope_scaling(out)
    return out


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}: supported are {_ROPE_TYPES}")
    if rope_type == "yarn" and not (scaling.get("original_max_position_embeddings") or 0) > 0:
        raise ValueError(f"yarn rope_scaling needs original_max_position_embeddings, got {scaling}")
    if not scaling.get("factor", 0) > 0:
        raise ValueError(f"rope_scaling factor must be positive, got {scaling.get('factor')!r}")
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if not 0 < low < high or scaling["original_max_position_embeddings"] < 1:
            raise ValueError(
                f"invalid llama3 rope_scaling {scaling}: need 0 < low_freq_factor < high_freq_factor"
            )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if (
        rope_type == "yarn"
    ):  # llama.cpp's keys; beta and mscale at their defaults as its converter writes them
        original = meta.get(f"{arch}.rope.scaling.original_context_length") or meta.get(
            f"{arch}.context_length"
        )
        scaling = {"rope_type": "yarn", "factor": float(meta[f"{arch}.rope.scaling.factor"]),
                   "original_max_position_embeddings": int(original) if original else None,
                   **dict.fromkeys(_YARN_OPTIONAL_KEYS)}  # fmt: skip
        _check_rope_scaling(scaling)
        return scaling
    raise ValueError(
        f"unsupported GGUF rope scaling type {rope_type!r}: supported are 'none', 'linear' and 'yarn'"
    )


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
