"""How a model computes: one compute backend per loaded model, chosen once at load by
:func:`tokenmill.model.backends.select_backend`.

The model (``llama.py``) describes the network; its backend decides how each piece runs:

* ``prepare(model)`` readies the weights once (packing for fast matmuls, kernels on quantized projections, the
  fused decode stack);
* ``plan(query_lens, seq_lens, block_tables, block_size)`` builds a step's :class:`AttentionMetadata`, with the
  one attention plan this backend runs and the fused elementwise ops (or None), once, before layer 0;
* ``fused_step(meta)`` hands the model a function that runs the whole step in one call, where the backend has
  one for it (else None);
* ``describe()`` is what ``tokenmill info --load`` and the start line report.

:class:`TorchBackend` is plain torch on the model's device: CUDA (SDPA for prefills), or CPU without the C++
kernels or in another dtype than float32 (chunked matmuls for prefills). The CPU kernel backend
(:class:`tokenmill.model.cpu.backend.CpuKernelBackend`) runs float32 on CPU when the kernels are loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.model import kv_format
from tokenmill.model.attention import (
    AttentionMetadata,
    DecodeBucket,
    KVCache,
    PrefillSeq,
    gather_context,
    plan_decode_buckets,
    plan_prefill,
)

_PREFILL_CHUNK_TOKENS = 128  # CPU prefill: queries per matmul chunk


@dataclass
class TorchPlan:
    """Decode rows in buckets of similar length (one SDPA call each), prefills one sequence at a time: through
    SDPA on CUDA, through query chunks of plain matmuls on CPU (faster there than the CPU SDPA kernel on long
    prompts)."""

    decode_buckets: list[DecodeBucket]
    prefills: list[PrefillSeq]
    use_sdpa: bool

    def attend(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty(
            q.shape, dtype=q.dtype, device=q.device
        )  # [T, Hq, D], contiguous whatever q's strides
        k_cache, v_cache = kv_cache
        for bucket in self.decode_buckets:
            out.index_copy_(0, bucket.token_rows, _decode_bucket(q, k_cache, v_cache, bucket, scale))
        attend_prefills(out, q, kv_cache, self.prefills, scale, self.use_sdpa)
        return out


def attend_prefills(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: KVCache,
    prefills: list[PrefillSeq],
    scale: float,
    use_sdpa: bool,
) -> None:
    """Each prefill's rows of ``out``, one sequence at a time (SDPA, or chunked matmuls)."""
    prefill = _prefill_sdpa if use_sdpa else _prefill_chunked
    k_cache, v_cache = kv_cache
    for seq in prefills:
        k = gather_context(k_cache, seq.block_ids, seq.seq_len, q.dtype)  # [S, Hkv, D]
        v = gather_context(v_cache, seq.block_ids, seq.seq_len, q.dtype)  # [S, Hkv, D]
        out[seq.start : seq.end] = prefill(q[seq.start : seq.end], k, v, seq, scale)


class TorchBackend:
    """Plain torch on one device: no fused ops, no fused forward; on CPU in float32, oneDNN's packed weights."""

    ops: Any = None  # the fused elementwise kernels a plan hands the layers (None: torch ops)
    decode_stack: Any = None  # a fused decode step over the model's weights (None: layer by layer)

    def __init__(
        self, device: torch.device | str = "cpu", pack: Callable[[Any], object] | None = None
    ) -> None:
        self.device = torch.device(device)
        self.name = "cuda" if self.device.type == "cuda" else "torch-cpu"
        self._pack = pack  # readies the weights' layout (oneDNN's blocked layout on CPU), or None

    def prepare(self, model: Any) -> None:
        """Ready ``model``'s weights (a ``llama.LlamaForCausalLM``) for this backend, once (at load), and make it
        the model's backend."""
        if self._pack is not None:
            self._pack(model)
        model.backend = self

    def plan(
        self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
    ) -> AttentionMetadata:
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, self.device)
        tables = meta.host_block_tables
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        prefill = [i for i, n in enumerate(query_lens) if n > 1]
        meta.plan = TorchPlan(
            decode_buckets=plan_decode_buckets(decode, meta, tables, self.device),
            prefills=[plan_prefill(i, meta, tables[i], self.device) for i in prefill],
            use_sdpa=self.device.type == "cuda",
        )
        return meta

    def fused_step(self, meta: AttentionMetadata) -> Callable[..., torch.Tensor] | None:
        """``fn(x, rope, meta, kv_caches) -> hidden`` running the whole step in one call, or None: the model
        runs layer by layer."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "attention": "torch (SDPA)" if self.device.type == "cuda" else "torch"}


def _decode_bucket(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket, scale: float
) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, row = k_cache.shape
    head_dim = q.shape[2]
    num_rows = bucket.token_rows.shape[0]
    max_len = bucket.max_num_blocks * block_size
    group = q.shape[1] // num_kv_heads
    flat_shape = (num_blocks, block_size * num_kv_heads * row)
    k = k_cache.view(flat_shape).index_select(0, bucket.block_ids)  # [n * max_blocks, bs * Hkv * row]
    v = v_cache.view(flat_shape).index_select(0, bucket.block_ids)
    k = kv_format.decode(k.view(num_rows, max_len, num_kv_heads, row), q.dtype)  # [n, L, Hkv, D]
    v = kv_format.decode(v.view(num_rows, max_len, num_kv_heads, row), q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [n, Hkv, L, D]
    # query heads h*group .. h*group+group-1 share KV head h: they become the "query length"
    q_rows = q.index_select(0, bucket.token_rows).view(
        num_rows, num_kv_heads, group, head_dim
    )  # [n, Hkv, G, D]
    out = F.scaled_dot_product_attention(
        q_rows, k, v, attn_mask=bucket.key_mask, scale=scale
    )  # [n, Hkv, G, D]
    return out.reshape(num_rows, num_kv_heads * group, head_dim)  # [n, Hq, D]


def _prefill_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    """q ``[Tq, Hq, D]``, k/v ``[S, Hkv, D]`` -> ``[Tq, Hq, D]`` with one SDPA call."""
    q_t, k_t, v_t = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    if seq.has_prefix:
        out = F.scaled_dot_product_attention(
            q_t, k_t, v_t, attn_mask=seq.causal_mask, scale=scale, enable_gqa=True
        )
    else:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [Tq, Hq, D]


def _prefill_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: PrefillSeq, scale: float
) -> torch.Tensor:
    """Like :func:`_prefill_sdpa`, as matmuls over query chunks; chunk c reads only keys it can see."""
    query_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    prefix_len = seq.seq_len - query_len
    q_g = q.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
    k_t = k.permute(1, 2, 0)  # [Hkv, D, S]
    v_t = v.transpose(0, 1)  # [Hkv, S, D]
    out = torch.empty(num_kv_heads, group, query_len, head_dim, dtype=q.dtype, device=q.device)
    for c0 in range(0, query_len, _PREFILL_CHUNK_TOKENS):
        c1 = min(query_len, c0 + _PREFILL_CHUNK_TOKENS)
        num_keys = prefix_len + c1  # the last query of the chunk sees this many keys
        q_c = q_g[:, :, c0:c1].reshape(num_kv_heads, group * (c1 - c0), head_dim)  # [Hkv, G*n, D]
        scores = torch.bmm(q_c, k_t[:, :, :num_keys]).float().mul_(scale)  # [Hkv, G*n, keys]
        scores = scores.view(num_kv_heads, group, c1 - c0, num_keys)  # [Hkv, G, n, keys]
        # keys before the chunk's own tokens are visible to all of it: only the [n, n] diagonal block needs a mask
        hidden_keys = ~seq.causal_mask[c0:c1, prefix_len + c0 : num_keys]  # [n, n], True above the diagonal
        scores[..., prefix_len + c0 :].masked_fill_(hidden_keys, float("-inf"))
        probs = scores.softmax(dim=-1).to(q.dtype).view(num_kv_heads, group * (c1 - c0), num_keys)
        out[:, :, c0:c1] = torch.bmm(probs, v_t[:, :num_keys]).view(num_kv_heads, group, c1 - c0, head_dim)
    return out.permute(2, 0, 1, 3).reshape(query_len, num_heads, head_dim)  # [Tq, Hq, D]
