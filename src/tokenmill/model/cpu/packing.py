"""Weights prepared once for fast fp32 and int8 matmuls on CPU.

- **fp32**: every projection, and a tied LM head, gets a reordered copy of its weight and the matmul that takes
  it, used at every batch size: column panels for the C++ ``panel_linear`` (``csrc/panel_linear.h``) on the
  AVX-512 and AVX2 kernel variants, else oneDNN's blocked layout (``mkldnn._reorder_linear_weight``). Measured on AVX-512
  (``benchmarks/bench_linear.py``, 2 threads, the 120 projections of SmolLM2-135M cycled from memory):
  panels 13.0 / 14.4 / 22.4 / 52.4 / 67.9 ms at 1 / 8 / 16 / 48 / 64 rows against oneDNN's 21.5 / 21.7 /
  25.6 / 63.6 / 76.6 ms, within 3% of it either way at 512-2,048 rows; oneDNN in turn beats ``F.linear``
  (one ``[3072, 576]`` projection: 0.79 vs 1.73 ms at 16 rows, 2.43 vs 3.63 ms at 64). The copy is a second
  copy of each weight (the loader's stays for the embedding lookup and the tests); the model's fp32 weights
  are memory-mapped from the dequantization cache, so that one is page cache, not process memory.
- **int8** (after :func:`~tokenmill.model.quant.quantize_model_int8`): the C++ ``small_linear`` kernel at every
  batch size, 3.5 / 3.4 / 4.5 / 7.6 ms at 1 / 2 / 4 / 8 rows against torch's int8 kernel's 8.1 / 10.2 / 11.4 /
  21.7 ms, and 1.5x faster than it up to 2,048 rows (``_weight_int8pack_mm`` only without the C++ kernels).
- :func:`build_decode_stack`: a C++ ``DecodeStack`` over the prepared weights, for decode-only steps: every layer
  in one call, no per-op dispatch (the CPU kernel backend, ``backend.py``, owns it and decides when it runs).

Packing sets ``packed_weight`` / ``packed_matmul`` on each :class:`~tokenmill.model.llama.Linear` (and the tied
head's on the model); the backends call these functions once, at load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.model.cpu.kernels import decode_stack_class, panel_linear_kernels, small_linear_kernel
from tokenmill.model.llama import Linear, LlamaForCausalLM, PackedMatmul
from tokenmill.model.quant import Int8Linear, QuantizedLinear

logger = logging.getLogger(__name__)
_PACK_FOR_ROWS = 64  # the batch size oneDNN picks its blocking for; any row count works
# The C++ decode stack takes every decode-only step: against the eager forward on the same matmuls (the
# embedded model, 200 tokens of context, one step) fp32 30.9 vs 35.7 ms at 12 rows, 37.9 vs 45.2 at 16, 66.1 vs
# 69.6 at 32, 131.7 vs 136.9 at 64; int8 ahead at every batch up to 64 (103.8 vs 113.2 ms).


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get("TOKENMILL_NO_PACK") == "1":
        return False
    return device.type == "cpu" and dtype == torch.float32


def pack_for_cpu(model: LlamaForCausalLM) -> int:
    """Reorder an fp32 CPU model's projection weights once (panels, else oneDNN's).

    Returns how many weights were reordered (0 when neither kernel is available: the plain ``F.linear`` path).
    """
    kernels = panel_linear_kernels()
    pack, matmul = kernels[:2] if kernels is not None else (_onednn_pack, _onednn_matmul)
    if kernels is None and not torch.backends.mkldnn.is_available():
        return 0
    try:
        num_packed = _pack_all(model, pack, matmul)
    except RuntimeError as exc:  # an unusual build without oneDNN's linear: keep the plain path
        logger.warning("weight packing failed (%s); using F.linear", exc)
        _pack_all(model, None, None)
        return 0
    return num_packed


def _pack_all(
    model: LlamaForCausalLM, pack: Callable[[torch.Tensor], torch.Tensor] | None, matmul: PackedMatmul | None
) -> int:
    num_packed = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed_weight = None if pack is None else pack(module.weight.detach())
            module.packed_matmul = matmul
            num_packed += 1
    if model.lm_head is None:
        model.packed_head = None if pack is None else pack(model.model.embed_tokens.weight.detach())
        model.packed_head_matmul = matmul
        num_packed += 1
    return num_packed if pack is not None else 0


def pack_encoder(encoder: torch.nn.Module) -> int:
    """oneDNN-reordered weights for an encoder's linears (``model/encoder.EncoderLinear``); how many."""
    from tokenmill.model.encoder import EncoderLinear

    num_packed = 0
    for module in encoder.modules():
        if isinstance(module, EncoderLinear):
            module.packed_weight = _onednn_pack(module.weight.detach())
            num_packed += 1
    return num_packed


def attach_cpu_kernels(model: LlamaForCausalLM) -> int:
    """Give every int8 CPU projection the ``small_linear`` kernel, if it built.

    Returns how many layers got the kernel (0 without it, TOKENMILL_NO_CPP=1, or a model with no int8 layer).
    """
    kernel = small_linear_kernel()
    if kernel is None:
        return 0
    num_attached = 0
    for module in model.modules():
        if isinstance(module, Int8Linear) and _fp32_cpu(module.scales):
            module.small_kernel = kernel  # every batch: faster than torch's int8 kernel at 1-2,048 rows
            num_attached += 1
    return num_attached


def build_decode_stack(model: LlamaForCausalLM) -> Any:
    """A C++ DecodeStack over ``model``'s weights (shared, not copied), or None if a layer does not fit it
    (not on CPU, an fp32 :class:`Linear` not packed as whole panels of the kernels' width, or a projection that
    is neither that, an :class:`Int8Linear` nor a :class:`QuantizedLinear` with its kernel)."""
    stack_class, kernels = decode_stack_class(), panel_linear_kernels()
    if stack_class is None or kernels is None:
        return None
    width, empty, tensors = kernels[2], torch.empty(0), []
    refusal = _stack_refusal(model.config)
    if refusal is not None:
        logger.info("no C++ decode stack: %s (decode steps run layer by layer)", refusal)
        return None
    for layer in model.model.layers:
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if not all(_fp32_cpu(t) for t in norms):
            return None
        tensors += norms
        for proj in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            if (
                isinstance(proj, Linear)
                and _is_panels(proj.packed_weight, width)
                and proj.out_features % width == 0
                and (
                    proj.bias is None or proj is layer.self_attn.qkv_proj
                )  # the stack adds qkv's bias itself
            ):
                tensors += (proj.packed_weight, empty)
            elif isinstance(proj, Int8Linear) and _fp32_cpu(proj.scales) and proj.weight_int8.is_contiguous():
                tensors += (proj.weight_int8, proj.scales)
            elif isinstance(proj, QuantizedLinear) and proj.kernel is not None:
                tensors += (proj.data, proj.meta)
            else:
                return None
        attn = layer.self_attn
        qkv_bias = getattr(attn.qkv_proj, "bias", None)
        if model.config.qkv_bias and (qkv_bias is None or not _fp32_cpu(qkv_bias)):
            logger.info("no C++ decode stack: the q/k/v bias is not an fp32 CPU tensor")
            return None
        q_norm = attn.q_norm.weight if attn.q_norm is not None else empty
        k_norm = attn.k_norm.weight if attn.k_norm is not None else empty
        tensors += (qkv_bias if qkv_bias is not None else empty, q_norm, k_norm)
    config = model.config
    final_norm = model.model.norm.weight
    if not _fp32_cpu(final_norm) or config.rope_dim % 2:
        return None
    return stack_class(
        tensors,
        final_norm,
        model._inv_freq.float(),
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.rms_norm_eps,
    )


def _stack_refusal(config: Any) -> str | None:
    """Why the stack cannot compute this model's layers, or None: a bias on o_proj, or Gemma 3's norms, GeGLU,
    scaled embeddings or queries, local RoPE."""
    if config.o_bias:
        return "o_proj has a bias"
    unlike_llama = (
        config.sandwich_norms
        or config.hidden_act != "silu"
        or config.embed_scale is not None
        or config.attention_scale is not None
        or config.rope_local_theta is not None
    )
    return f"{config.model_type} layers" if unlike_llama else None


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _is_panels(t: torch.Tensor | None, width: int) -> bool:
    return t is not None and t.dim() == 3 and t.shape[2] == width and _fp32_cpu(t)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)


def _onednn_matmul(x: torch.Tensor, packed_weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [n, in]`` times a oneDNN-packed ``[out, in]`` weight -> ``[n, out]`` (a plain dense tensor)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, None, "none", [], "")
