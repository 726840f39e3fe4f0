"""How K and V are stored in the paged cache, per ``--kv-cache-dtype``: one place for the bytes of a row.

A layer's cache is two tensors ``[num_blocks, block_size, num_kv_heads, row]``; a (token, KV head) row holds that
head's ``head_dim`` values:

* float32, float16, bfloat16: the values themselves (``row = head_dim``), rounded to nearest even;
* float8_e4m3fn (``fp8``, ``fp8_e4m3``): the values as fp8 e4m3 with no scale (vLLM's fp8 with its default scale
  of 1.0), rounded to nearest even and saturating at +-448;
* int8: ``head_dim`` int8 codes, then that row's fp32 scale in 4 trailing bytes (``row = head_dim + 4``): the scale
  is the row's largest magnitude / 127, the codes ``x / scale`` rounded to nearest even (all zero for a zero row).
  A row of keys or values carries its own range, as llama.cpp's ``q8_0`` cache carries one per 32 values.

The C++ kernels (``cpu/csrc/simd.h``, ``KvType``) read and write the same bytes; :func:`encode` is what torch-side
writes use, :func:`decode` what torch-side reads use.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 4  # an int8 row's fp32 scale, after its codes
_INT8_MAX = 127.0


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row in a cache of ``dtype``."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head size of a cache ``[..., row]``."""
    return cache.shape[-1] - INT8_SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[-1]


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., head_dim]`` (any float dtype) as cache rows ``[..., row_width]`` of ``dtype``."""
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / _INT8_MAX  # [..., 1]
    codes = torch.where(scale > 0, x / scale, torch.zeros_like(x)).round_().clamp_(-_INT8_MAX, _INT8_MAX)
    out = torch.empty(*x.shape[:-1], x.shape[-1] + INT8_SCALE_BYTES, dtype=torch.int8, device=x.device)
    out[..., : x.shape[-1]] = codes.to(torch.int8)
    out[..., x.shape[-1] :] = scale.contiguous().view(torch.int8)
    return out


def as_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor ``index_copy_`` takes on CPU: fp8 as its bytes (torch has no fp8 ``index_copy_``), else
    itself."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def decode(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows ``[..., row]`` as values ``[..., head_dim]`` in ``dtype``."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)
