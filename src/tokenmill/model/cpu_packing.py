"""Weights prepared once for fast fp32 and int8 matmuls on CPU.

Two kernels, picked per call by the number of rows:

- **few rows** (decode of 1-4 streams; int8 weights: every batch): the C++ ``small_linear`` kernel
  (:func:`tokenmill.model.cpu_kernels.small_linear_kernel`) reads the weight as stored, once, prefetching 32 KB
  ahead. Measured here (``benchmarks/bench_small_linear.py``, 2 threads, the 120 projections of
  SmolLM2-135M cycled from memory): fp32 13.8 / 13.4 / 15.0 / 24.4 ms at 1 / 2 / 4 / 8 rows against oneDNN's
  20.7 / 22.1 / 19.3 / 22.5 ms; int8 3.5 / 3.4 / 4.5 / 7.6 ms against torch's int8 kernel's 8.1 / 10.2 / 11.4
  / 21.7 ms, and 1.5x faster than it up to 2,048 rows.
- **more rows**: oneDNN with a reordered ("packed") copy of each fp32 weight. Measured here (weights cycled
  from memory, one ``[3072, 576]`` projection): ``F.linear`` 1.73 ms at 16 rows and 3.63 ms at 64; the packed
  weight 0.79 ms and 2.43 ms, and 20% faster at 512 rows. The packed copy is a second copy of each weight (the
  loader's copy stays for the embedding lookup, the few-row kernel and tests); the model's fp32 weights are
  memory-mapped from the dequantization cache, so that copy is page cache, not process memory.
  Int8 layers keep ``small_linear`` here too (torch's ``_weight_int8pack_mm`` only without the C++ kernels).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tokenmill.model.cpu_kernels import decode_stack_class, small_linear_kernel
from tokenmill.model.llama import Linear, LlamaForCausalLM
from tokenmill.model.quant import Int8Linear

logger = logging.getLogger(__name__)
_PACK_FOR_ROWS = 64  # the batch size oneDNN picks its blocking for; any row count works
# Up to how many rows the few-row kernel beats the alternative (the measurements above).
SMALL_FP32_MAX_ROWS = 4
SMALL_INT8_MAX_ROWS = 1 << 30  # every batch: faster than torch's int8 kernel at 1-2,048 rows
# The C++ decode stack (the model's forward + head at 100 tokens of context, against the eager forward): fp32
# 13.9 vs 16.7 ms at 1 row, 20.1 vs 27.9 at 4, even at 8 (34.3 vs 33.8), behind from 16 (59.8 vs 46.3); int8
# ahead at every batch up to 64 (103.8 vs 113.2 ms).
DECODE_STACK_MAX_ROWS_FP32 = 8
DECODE_STACK_MAX_ROWS_INT8 = 1 << 30


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get("TOKENMILL_NO_PACK") == "1":
        return False
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_for_cpu(model: LlamaForCausalLM) -> int:
    """Prepare an fp32 CPU model: oneDNN-packed weights and the few-row kernel; returns how many were packed.

    Int8 layers (after :func:`~tokenmill.model.quant.quantize_model_int8`) get the few-row kernel only.
    """
    attach_cpu_kernels(model)
    num_packed = 0
    try:
        for module in model.modules():
            if isinstance(module, Linear) and module.packed_weight is None:
                module.packed_weight = _pack(module.weight)
                num_packed += 1
        if model.lm_head is None:
            model.packed_head = _pack(model.model.embed_tokens.weight)
            num_packed += 1
    except RuntimeError as exc:  # an unusual build without oneDNN's linear: keep the plain path
        logger.warning("oneDNN weight packing failed (%s); using F.linear", exc)
        for module in model.modules():
            if isinstance(module, Linear):
                module.packed_weight = None
        model.packed_head = None
        return 0
    return num_packed


def attach_cpu_kernels(model: LlamaForCausalLM) -> int:
    """Give every fp32 CPU projection (and a tied head) and every int8 one the few-row kernel, if it built,
    and the model a C++ :class:`DecodeStack` for decode-only steps when every layer can use it.

    Returns how many layers got the few-row kernel (0 without the kernel, TOKENMILL_NO_CPP=1, or a
    non-fp32/non-CPU model).
    """
    kernel = small_linear_kernel()
    if kernel is None:
        return 0
    num_attached = 0
    for module in model.modules():
        if isinstance(module, Linear) and _fp32_cpu(module.weight):
            module.small_kernel, module.small_max_rows = kernel, SMALL_FP32_MAX_ROWS
            num_attached += 1
        elif isinstance(module, Int8Linear) and _fp32_cpu(module.scales):
            module.small_kernel, module.small_max_rows = kernel, SMALL_INT8_MAX_ROWS
            num_attached += 1
    if model.lm_head is None and _fp32_cpu(model.model.embed_tokens.weight):
        model.small_head, model.small_head_max_rows = kernel, SMALL_FP32_MAX_ROWS
        num_attached += 1
    model.decode_stack = build_decode_stack(model)
    int8 = any(isinstance(module, Int8Linear) for module in model.model.layers.modules())
    max_rows = DECODE_STACK_MAX_ROWS_INT8 if int8 else DECODE_STACK_MAX_ROWS_FP32
    model.decode_stack_max_rows = max_rows if model.decode_stack is not None else 0
    return num_attached


def build_decode_stack(model: LlamaForCausalLM) -> Any:
    """A C++ DecodeStack over ``model``'s weights (shared, not copied), or None if a layer does not fit it
    (not fp32 on CPU, or a projection that is neither :class:`Linear` nor :class:`Int8Linear`)."""
    stack_class = decode_stack_class()
    if stack_class is None:
        return None
    empty = torch.empty(0)
    tensors: list[torch.Tensor] = []
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
            if isinstance(proj, Linear) and _fp32_cpu(proj.weight):
                tensors += (proj.weight, empty)
            elif isinstance(proj, Int8Linear) and _fp32_cpu(proj.scales) and proj.weight_int8.is_contiguous():
                tensors += (proj.weight_int8, proj.scales)
            else:
                return None
    config = model.config
    final_norm = model.model.norm.weight
    if not _fp32_cpu(final_norm) or config.head_dim % 2:
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


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_ROWS)
