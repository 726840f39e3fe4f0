"""The decoder over a flat batch of tokens and a paged KV cache: Llama, and the families that differ from it only
in configuration (Mistral, Qwen2, Qwen3, Phi-3, Gemma 3: ``config.py`` lists what differs).

One forward takes every new token of the step as one row (``input_ids``/``positions`` ``[num_tokens]``);
:class:`~tokenmill.model.attention.AttentionMetadata` says which rows form which sequence. Q, K and V come
from one fused matmul, gate and up from another. Weights arrive with Hugging Face names through
:meth:`LlamaForCausalLM.load_hf_state_dict`, which does the fusing (Phi-3 checkpoints come fused already).

How each piece runs is the model's compute backend's choice (``backend.py``): it plans the step's attention
(:meth:`LlamaForCausalLM.plan_attention`), hands the layers its fused elementwise ops through the metadata
(``meta.ops``, None for torch's), and may run a whole step in one call (``fused_step``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.attention import AttentionMetadata, paged_attention, write_kv
from tokenmill.model.attention import KVCache as KVCache  # re-exported: the runner and the backends take it
from tokenmill.model.backend import TorchBackend
from tokenmill.model.config import LlamaConfig

# fn(x [M, K], packed weight, N) -> [M, N]: a matmul by a weight reordered once for it (cpu/packing.py)
PackedMatmul = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# Tensors some checkpoints carry that the model recomputes instead.
_IGNORED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def project(linear: nn.Module, x: torch.Tensor, lora: Any, layer: int, name: str) -> torch.Tensor:
    """``linear(x)``, plus each row's LoRA delta when the step has adapters (``lora``: a ``model.lora.StepLoRA``).
    A tensor-parallel row-parallel projection (one with ``inner`` and ``reduce``) sums its ranks' partial
    products: the delta of this rank's share of the inputs joins that sum."""
    if lora is None:
        return linear(x)  # type: ignore[no-any-return]
    reduce = getattr(linear, "reduce", None)
    if reduce is None:
        return lora.add(layer, name, x, linear(x))  # type: ignore[no-any-return]
    return reduce(lora.add(layer, name, x, linear.inner(x)))  # type: ignore[no-any-return]


class Linear(nn.Linear):
    """``nn.Linear`` without random init (bias off unless asked): a loader fills the weight.

    On CPU in fp32 :func:`tokenmill.model.cpu.packing.pack_for_cpu` adds ``packed_weight``, the same weight
    reordered once (column panels for the C++ ``panel_linear``, else oneDNN's blocked layout), and
    ``packed_matmul``, which multiplies by it; the forward then uses them at every batch size.
    """

    packed_weight: torch.Tensor | None = None
    packed_matmul: PackedMatmul | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_matmul is not None and self.packed_weight is not None and x.dim() == 2:
            out = self.packed_matmul(x, self.packed_weight, self.out_features)
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` without random init (on ``meta`` that init alone imports torch._dynamo: ~1.5 s)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """``ops``: the backend's fused kernels (``meta.ops``), used for a contiguous matrix."""
        if ops is not None and x.dim() == 2 and x.is_contiguous():
            return ops.rms_norm(x, self.weight, self.eps)  # type: ignore[no-any-return]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: LlamaConfig, local: bool = False) -> torch.Tensor:
    """``[rope_dim // 2]`` float32 angular frequencies, with llama3 / linear scaling applied; ``local``: those of
    the sliding-window layers with a base of their own (``rope_local_theta``, unscaled, as Gemma 3's)."""
    dim = config.rope_dim
    # explicit CPU device: stays real even under a `with torch.device("meta")` block
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if local and config.rope_local_theta is not None:
        return 1.0 / (config.rope_local_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling is not None and scaling["rope_type"] == "llama3":
        # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        original_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        blend = ((original_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        inv_freq = torch.where(
            wavelen < original_len / high,
            inv_freq,
            torch.where(wavelen > original_len / low, inv_freq / factor, blended),
        )
    elif scaling is not None and scaling["rope_type"] == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, scaling, dim, config.rope_theta)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device="cpu")
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], dim: int, base: float) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the original context are
    interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times kept, a linear ramp between,
    the ramp's ends rounded outwards to whole dimensions unless ``truncate`` is false (transformers' reading)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(num_rotations: float) -> float:  # the dimension whose frequency turns num_rotations times
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True) is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolated (kept), 0: interpolated
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_factor(config: LlamaConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature (0.1 ln(factor) + 1, or the ratio of
    ``mscale`` to ``mscale_all_dim`` ones, or ``attention_factor`` as given); 1 for every other RoPE."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, R // 2] each, for the first R dims of each head


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by per-token angles; ``cos``/``sin`` are ``[T, 1, R // 2]`` for the first R dims.

    Pairs are (i, i + R/2), the Hugging Face layout (GGUF's interleaved pairs are undone at load time); dims past
    R (partial rotary) pass through.
    """
    rotary = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    x1, x2 = x_rot.chunk(2, dim=-1)  # [T, H, R/2] each
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if x_pass.shape[-1] == 0 else torch.cat((rotated, x_pass), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or self.head_dim**-0.5
        self.window = config.layer_window(layer)
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        # Qwen3: RMSNorm over each head's q and k before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = project(self.qkv_proj, x, meta.lora, self.layer, "qkv_proj")  # [T, q_size + 2 * kv_size]
        k_cache, v_cache = kv_cache
        cos, sin = rope
        ops = meta.ops
        if self.q_norm is not None and self.k_norm is not None:
            if ops is not None:
                ops.qk_norm_(
                    qkv,
                    self.q_norm.weight,
                    self.k_norm.weight,
                    self.num_heads,
                    self.num_kv_heads,
                    self.q_norm.eps,
                )
            else:
                q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
                q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, q_size)  # per head
                k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, kv_size)
                qkv = torch.cat([q, k, v], dim=-1)
        if (
            ops is not None
        ):  # one pass: rotate q/k, store k/v in the cache's format (as the decode stack does)
            cos2d, sin2d = cos.view(num_tokens, -1), sin.view(num_tokens, -1)  # [T, R/2]
            q = ops.rope_write_kv(
                qkv, cos2d, sin2d, k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads
            )  # [T, Hq, D]
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, Hq, D]
            k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta, self.scale, window=self.window)  # [T, Hq, D]
        return project(
            self.o_proj, out.view(num_tokens, q_size), meta.lora, self.layer, "o_proj"
        )  # [T, hidden]


# A long step's rows go through the MLP in chunks: at least MLP_CHUNK_ROWS (llama.cpp's prompt batch), more where
# their fp32 gate/up output stays within MLP_CHUNK_BYTES. A 2,048-token step of Qwen2.5-1.5B then holds 37 MB of
# gate/up output instead of 147 MB; memory touched for the first time costs about 3 ms per MB under this KVM
# (AMD EPYC family 25 model 17, 2026-12-06), and a first long prompt paid it. Smaller chunks cost the kernels:
# 256 rows took 1-4% longer than 512 (its 28 MLPs, AVX-512 and AVX2).
MLP_CHUNK_ROWS = 512
MLP_CHUNK_BYTES = 32 << 20


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)
        self.gelu = config.hidden_act == "gelu_tanh"
        self.hidden_size = config.hidden_size
        self.chunk_rows = max(MLP_CHUNK_ROWS, MLP_CHUNK_BYTES // (2 * config.intermediate_size * 4))

    def forward(self, x: torch.Tensor, ops: Any = None, lora: Any = None) -> torch.Tensor:
        """``lora``: the step's adapters (``model.lora.StepLoRA``), None without. At least twice ``chunk_rows``
        rows go in near-equal chunks of ``chunk_rows`` to twice that (not with adapters, whose rows index the whole
        step, nor across tensor-parallel ranks, where each chunk would be one more all-reduce)."""
        num_rows = x.shape[0]
        if num_rows < 2 * self.chunk_rows or lora is not None or hasattr(self.down_proj, "reduce"):
            return self._forward(x, ops, lora)
        num_chunks = num_rows // self.chunk_rows
        bounds = [num_rows * i // num_chunks for i in range(num_chunks + 1)]
        out = x.new_empty(num_rows, self.hidden_size)
        for start, end in itertools.pairwise(bounds):
            out[start:end] = self._forward(x[start:end], ops, None)
        return out

    def _forward(self, x: torch.Tensor, ops: Any, lora: Any) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, lora, self.layer, "gate_up_proj")  # [T, 2 * intermediate]
        if self.gelu:  # GeGLU (Gemma)
            gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
            hidden = F.gelu(gate, approximate="tanh") * up
        elif ops is not None and gate_up.is_contiguous():
            if lora is None and self._down_takes_silu(ops):  # the product never stored in fp32
                return ops.quant_linear_silu(gate_up, self.down_proj.data, self.down_proj.meta)  # type: ignore[no-any-return]
            hidden = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [T, intermediate] each
            hidden = F.silu(gate) * up
        return project(self.down_proj, hidden, lora, self.layer, "down_proj")

    def _down_takes_silu(self, ops: Any) -> bool:
        """Whether the down projection is a bias-free quantized linear on ``ops``' own ``quant_linear``, which
        ``quant_linear_silu`` runs with silu(gate) * up made as its input is read."""
        down = self.down_proj
        kernel = getattr(ops, "quant_linear", None)
        return (
            kernel is not None
            and getattr(down, "kernel", None) == kernel
            and getattr(down, "bias", 0) is None
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer)
        # Llama's name for the norm before the MLP; with sandwich norms (Gemma 3) the one after attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps) if config.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps) if config.sandwich_norms else None
        self.mlp = LlamaMLP(config, layer)
        self.rope_index = 1 if config.layer_rope_local(layer) else 0  # which of the model's RoPE tables

    def forward(
        self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``. On the fused CPU path ``x`` is updated in place (it is the
        forward's own tensor: the embedding lookup or the previous layer's sum)."""
        ops = meta.ops
        attn_out = self.self_attn(self.input_layernorm(x, ops), rope, meta, kv_cache)
        post_norm = self.post_attention_layernorm
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            x = x + post_norm(attn_out, ops)  # Gemma 3: each block's output normed before the residual add
            mlp_out = self.mlp(self.pre_feedforward_layernorm(x, ops), ops, meta.lora)
            return x + self.post_feedforward_layernorm(mlp_out, ops)
        if ops is not None and attn_out.is_contiguous():  # x += attn_out, then the norm, in one pass
            normed = ops.add_rms_norm_(x, attn_out, post_norm.weight, post_norm.eps)
            return x + self.mlp(normed, ops, meta.lora)
        x = x + attn_out
        return x + self.mlp(post_norm(x), ops, meta.lora)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.requires_grad_(False)
        # Plain attributes, not buffers: they stay real (and float32) when the model is built on "meta". The global
        # layers' frequencies, then (Gemma 3) the local layers' (LlamaDecoderLayer.rope_index picks one).
        self._inv_freq = rope_inv_freq(config)
        self._inv_freqs = [self._inv_freq]
        self._rope_scales = [rope_attention_factor(config)]  # cos and sin times this (YaRN's temperature)
        if config.rope_local_theta is not None:
            self._inv_freqs.append(rope_inv_freq(config, local=True))
            self._rope_scales.append(1.0)
        # the tied head's weight reordered once, and the matmul that takes it (cpu.packing)
        self.packed_head: torch.Tensor | None = None
        self.packed_head_matmul: PackedMatmul | None = None
        # how it computes (backend.py): set once by a backend's prepare(); plain torch until then
        self.backend: TorchBackend | None = None

    def compute_backend(self) -> TorchBackend:
        """The backend that prepared this model; for one never prepared, plain torch on its weights' device."""
        if self.backend is None:
            self.backend = TorchBackend(self.model.norm.weight.device)
        return self.backend

    def plan_attention(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
    ) -> AttentionMetadata:
        """A step's metadata, planned by this model's backend (see :meth:`AttentionMetadata.build`)."""
        return self.compute_backend().plan(query_lens, seq_lens, block_tables, block_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[num_tokens]`` -> final-normed hidden states ``[num_tokens, hidden]``.

        Writes the new tokens' K/V into ``kv_caches[layer]`` at ``meta.slot_mapping`` before attending.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need one KV cache per layer ({len(self.model.layers)}), got {len(kv_caches)}")
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if (
            self.config.embed_scale is not None
        ):  # Gemma: sqrt(hidden), in the activations' dtype as transformers
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        # one rotation for both paths: a token's K/V must not depend on which path computed it (with 8-bit
        # activations the rounding turns an ulp of difference into a step)
        ropes = [
            self._rope_cos_sin(inv_freq, positions, x.dtype, scale)
            for inv_freq, scale in zip(self._inv_freqs, self._rope_scales)
        ]
        fused = self.compute_backend().fused_step(meta)
        if fused is not None:  # the whole step in one call (the backend's decode stack)
            return fused(x, ropes[0], meta, kv_caches)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, ropes[layer.rope_index], meta, kv_cache)
        return self.model.norm(x, meta.ops)

    @staticmethod
    def _rope_cos_sin(
        inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
    ) -> Rope:
        angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2], float32
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        # [T, 1, D/2]: broadcast over heads
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32. Pass only the rows that need logits."""
        if self.lm_head is None:  # tied: the embedding table is the head
            if self.packed_head_matmul is not None and self.packed_head is not None:
                return self.packed_head_matmul(hidden, self.packed_head, self.config.vocab_size).float()
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # an nn.Linear, or an Int8Linear after quantization

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights, fusing q/k/v and gate/up. Tensors are cast to the model's dtype.

        A model built on the ``meta`` device takes the tensors' device (no second copy is made).
        """
        self.load_fused_state_dict(fuse_hf_state_dict(self.config, state_dict))

    def load_fused_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights under this module's own names (``...qkv_proj.weight``), as :func:`fuse_hf_state_dict` makes.

        On a ``meta`` model a tensor already of the right dtype becomes the parameter itself (no copy).
        """
        params = dict(self.named_parameters())
        # a parameter already real (a quantized module's bias, set when it was built) needs no tensor here
        missing = [name for name, p in params.items() if name not in state_dict and p.is_meta]
        unexpected = [name for name in state_dict if name not in params]
        if missing or unexpected:
            raise ValueError(
                f"fused weights do not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
            )
        for name, tensor in state_dict.items():
            old = params[name]
            if tuple(old.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(old.shape)}"
                )
            module_name, _, attr = name.rpartition(".")
            if old.is_meta:
                setattr(
                    self.get_submodule(module_name),
                    attr,
                    nn.Parameter(tensor.to(old.dtype), requires_grad=False),
                )
            else:
                old.copy_(tensor)


def hf_tensor_names(config: LlamaConfig, fused: bool | None = None) -> list[str]:
    """The Hugging Face tensor names a checkpoint of ``config`` has; ``fused`` (default: Phi-3's way) with q/k/v
    and gate/up each one tensor."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    fused = config.model_type == "phi3" if fused is None else fused
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if config.sandwich_norms:
            names += [f"{p}.pre_feedforward_layernorm.weight", f"{p}.post_feedforward_layernorm.weight"]
        attn = ("qkv", "o") if fused else ("q", "k", "v", "o")
        names += [f"{p}.self_attn.{x}_proj.weight" for x in attn]
        if config.qkv_bias:
            names += [f"{p}.self_attn.{x}_proj.bias" for x in (("qkv",) if fused else ("q", "k", "v"))]
        if config.o_bias:
            names.append(f"{p}.self_attn.o_proj.bias")
        if config.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names += [
            f"{p}.mlp.{x}_proj.weight" for x in (("gate_up", "down") if fused else ("gate", "up", "down"))
        ]
    return names


def fuse_hf_state_dict(
    config: LlamaConfig, state_dict: dict[str, torch.Tensor], absent: set[str] | frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """HF names -> this module's names; ValueError listing missing or unexpected tensors.

    ``absent``: names another module took (a quantized projection's weights and bias): neither expected nor
    fused here; a fused tensor none of whose parts remain is left out.
    """
    fused_qkv = any(n.endswith("qkv_proj.weight") for n in state_dict) or config.model_type == "phi3"
    expected = [n for n in hf_tensor_names(config, fused=fused_qkv) if n not in absent]
    allowed = set(expected)
    if config.tie_word_embeddings:
        allowed.add("lm_head.weight")  # some tied checkpoints store the copy anyway; it is not used
    missing = [n for n in expected if n not in state_dict]
    unexpected = sorted(n for n in state_dict if n not in allowed and not _IGNORED.fullmatch(n))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(
                f"missing tensors ({len(missing)}): {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )
        if unexpected:
            parts.append(
                f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:8])}"
                + (" ..." if len(unexpected) > 8 else "")
            )
        raise ValueError(f"checkpoint does not match the {config.model_type} config: " + "; ".join(parts))
    fused: dict[str, torch.Tensor] = {}
    for name in expected:
        if re.search(r"\.(k|v|up)_proj\.(weight|bias)$", name):
            continue  # folded into q / gate below
        match = re.search(r"\.(q|gate)_proj\.(weight|bias)$", name)
        if match is None and config.norm_offset and name.endswith("norm.weight"):
            fused[name] = state_dict[name].float() + config.norm_offset  # the multiplier (Gemma: 1 + w)
            continue
        if match is None:
            fused[name] = state_dict[name]
            continue
        kind, what = match.groups()
        prefix = name[: match.start()]
        if kind == "q":
            parts = [state_dict[f"{prefix}.{x}_proj.{what}"] for x in ("q", "k", "v")]
            _check_fused_dims(prefix, parts[0].shape[0], parts[1].shape[0], config)
            fused[f"{prefix}.qkv_proj.{what}"] = torch.cat(parts, dim=0)  # [(Hq + 2 Hkv) * D, ...]
        else:
            parts = [state_dict[f"{prefix}.{x}_proj.{what}"] for x in ("gate", "up")]
            fused[f"{prefix}.gate_up_proj.{what}"] = torch.cat(parts, dim=0)  # [2 * intermediate, hidden]
    return fused


def _check_fused_dims(prefix: str, q_rows: int, k_rows: int, config: LlamaConfig) -> None:
    want_q, want_k = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    if (q_rows, k_rows) != (want_q, want_k):
        raise ValueError(f"{prefix}: q/k projections have {q_rows}/{k_rows} rows, expected {want_q}/{want_k}")


def build_llama(
    config: LlamaConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, *, fused: bool = False
) -> LlamaForCausalLM:
    """A model holding ``state_dict`` in ``dtype``, on the tensors' device, without random init.

    ``fused``: the names are this module's own (:func:`fuse_hf_state_dict` output), not Hugging Face's.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to(dtype)
    if fused:
        model.load_fused_state_dict(state_dict)
    else:
        model.load_hf_state_dict(state_dict)
    return model.eval()
