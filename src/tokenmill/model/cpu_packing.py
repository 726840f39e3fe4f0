"""Weights reordered once for oneDNN's fp32 matmul on CPU.

Measured here (2 threads, weights cycled so they come from memory as in a real forward, one
``[3072, 576]`` projection): ``F.linear`` 1.73 ms at 16 rows and 3.63 ms at 64; the oneDNN-packed weight
0.79 ms and 2.43 ms, the same at 1 row (0.63 ms), and 20% faster at 512 rows. The packed copy is a second
copy of each weight (the loader's copy stays for the embedding lookup and for tests); the model's fp32
weights are memory-mapped from the dequantization cache, so that copy is page cache, not process memory.
"""

from __future__ import annotations

import logging
import os

import torch

from tokenmill.model.llama import Linear, LlamaForCausalLM

logger = logging.getLogger(__name__)
_PACK_FOR_ROWS = 64  # the batch size oneDNN picks its blocking for; any row count works


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if os.environ.get("TOKENMILL_NO_PACK") == "1":
        return False
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_for_cpu(model: LlamaForCausalLM) -> int:
    """Give every projection (and a tied LM head) a oneDNN-packed weight; returns how many were packed."""
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


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_FOR_ROWS)
