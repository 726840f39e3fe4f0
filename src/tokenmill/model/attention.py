"""Paged attention over a block-structured KV cache: the step's metadata, the cache writes, and the paths every
backend shares.

The cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, row]`` (a row is ``head_dim``
values, or int8 codes and their scale: ``kv_format.py``); a sequence's
keys live in the blocks its block table lists, token ``t`` at block ``table[t // block_size]``, offset
``t % block_size``. A step's tokens come as one flat batch; :class:`AttentionMetadata` says which rows
belong to which sequence, and carries the attention plan of the model's compute backend (``backend.py``),
built once per step before layer 0 with every index tensor the layers need.

``paged_attention`` runs that plan, or, for a step with a sequence past a sliding window, the windowed path.
``paged_attention_reference`` is the slow, obviously-correct version the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokenmill.model import kv_format

_MAX_DECODE_BUCKETS = 4
_ROWS_PER_DECODE_BUCKET = 16  # no more buckets than one per this many decode rows


@dataclass
class DecodeBucket:
    """Decode rows of similar context length, attended in one batched call."""

    token_rows: torch.Tensor  # [num_rows] int64: flat batch rows
    block_ids: torch.Tensor  # [num_rows * max_num_blocks] int64: each row's blocks, padded with block 0
    key_mask: torch.Tensor  # [num_rows, 1, 1, max_num_blocks * block_size] bool: True for keys in context
    max_num_blocks: int


@dataclass
class PrefillSeq:
    """One sequence with several new tokens: flat rows ``start:end``, context of ``seq_len`` tokens."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    causal_mask: torch.Tensor  # [query_len, seq_len] bool: True where query i may see key j

    @property
    def has_prefix(self) -> bool:
        return self.seq_len > self.end - self.start


KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (K, V), each [num_blocks, block_size, Hkv, D]


class AttentionPlan(Protocol):
    """How a backend attends a step: ``q [num_tokens, num_heads, head_dim]`` -> the same shape."""

    def attend(
        self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    """Where every token of the flat batch belongs and where its K/V live. A backend's ``plan`` builds it."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]  # [num_seqs + 1]: seq i's new tokens are rows [i]:[i + 1] of this list
    seq_lens: list[int]  # [num_seqs]: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    block_size: int
    host_block_tables: list[list[int]]  # the same tables as lists (entries past a window made valid ids)
    plan: AttentionPlan | None = None  # the backend's, shared by all layers
    ops: Any = None  # the fused elementwise kernels the layers use (None: torch ops)
    lora: Any = None  # the step's LoRA adapters (model.lora.StepLoRA; None: none), added to each projection

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Sequence ``i`` computes its last ``query_lens[i]`` tokens (the rest of its context is cached). No plan:
        a backend adds its own."""
        # positions   0 ............ seq_len - query_len ......... seq_len - 1
        #             |  cached K/V (prefix)  |  new tokens (this step)  |
        # flat rows                           | query_start_loc[i] .. query_start_loc[i + 1] - 1
        # K/V slot of position p: block_tables[i][p // block_size] * block_size + p % block_size
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        query_start_loc = [0]
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < query_len <= seq_len:
                raise ValueError(
                    f"need 0 < query_len <= seq_len, got query_len={query_len}, seq_len={seq_len}"
                )
            if len(table) * block_size < seq_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens")
            query_start_loc.append(query_start_loc[-1] + query_len)
            for pos in range(seq_len - query_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_num_blocks = max((len(t) for t in block_tables), default=0)
        # entries released outside a sliding window (-1) are never read: any valid id will do
        if any(t and min(t) < 0 for t in block_tables):
            block_tables = [[max(b, 0) for b in t] for t in block_tables]
        padded = [t + [0] * (max_num_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc,
            seq_lens=list(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).view(
                len(seq_lens), max_num_blocks
            ),
            block_size=block_size,
            host_block_tables=block_tables,  # read only, never changed: no copy
        )


def num_blocks_for(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def plan_decode_buckets(
    seqs: list[int], meta: AttentionMetadata, tables: list[list[int]], device: torch.device | str
) -> list[DecodeBucket]:
    """Sort decode rows by length and cut them into a few equal-count buckets, to limit padding."""
    if not seqs:
        return []
    bs = meta.block_size
    seqs = sorted(seqs, key=lambda i: meta.seq_lens[i])
    num_buckets = min(_MAX_DECODE_BUCKETS, -(-len(seqs) // _ROWS_PER_DECODE_BUCKET))
    buckets = []
    for b in range(num_buckets):
        members = seqs[b * len(seqs) // num_buckets : (b + 1) * len(seqs) // num_buckets]
        lens = [meta.seq_lens[i] for i in members]
        max_num_blocks = num_blocks_for(max(lens), bs)
        block_ids: list[int] = []
        for i, seq_len in zip(members, lens):
            used = tables[i][: num_blocks_for(seq_len, bs)]
            block_ids += used + [0] * (max_num_blocks - len(used))
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        key_pos = torch.arange(max_num_blocks * bs, device=device)
        buckets.append(
            DecodeBucket(
                token_rows=torch.tensor(
                    [meta.query_start_loc[i] for i in members], dtype=torch.int64, device=device
                ),
                block_ids=torch.tensor(block_ids, dtype=torch.int64, device=device),
                key_mask=(key_pos[None, :] < lens_t[:, None])[:, None, None, :],  # [n, 1, 1, L]
                max_num_blocks=max_num_blocks,
            )
        )
    return buckets


def plan_prefill(i: int, meta: AttentionMetadata, table: list[int], device: torch.device | str) -> PrefillSeq:
    start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
    query_len = end - start
    # Query q (absolute position seq_len - query_len + q) sees keys 0 .. seq_len - query_len + q.
    causal_mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - query_len)
    block_ids = torch.tensor(
        table[: num_blocks_for(seq_len, meta.block_size)], dtype=torch.int64, device=device
    )
    return PrefillSeq(start=start, end=end, seq_len=seq_len, block_ids=block_ids, causal_mask=causal_mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their flat cache slots."""
    num_blocks, block_size, num_kv_heads, row = k_cache.shape
    num_slots = num_blocks * block_size
    # view (not reshape): a non-contiguous cache must fail loudly, not be written into a copy
    # in the cache's format (rounded to nearest even, int8 with a scale per row, as the C++ decode stack writes)
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = kv_format.as_storage(kv_format.encode(x, cache.dtype))
        kv_format.as_storage(cache.view(num_slots, num_kv_heads, row)).index_copy_(0, slot_mapping, rows)


def gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A sequence's first ``seq_len`` cached tokens, ``[seq_len, num_kv_heads, head_dim]`` in ``dtype``."""
    num_blocks, block_size, num_kv_heads, row = cache.shape
    flat = cache.view(num_blocks, block_size * num_kv_heads * row).index_select(0, block_ids)
    return kv_format.decode(flat.view(-1, num_kv_heads, row)[:seq_len], dtype)  # [seq_len, Hkv, D]


def paged_attention_windowed(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, window: int
) -> torch.Tensor:
    """Sliding-window attention, one sequence at a time: each reads only the blocks holding keys some query of its
    can see (the window before its first new token onwards), one SDPA call with the causal-and-window mask."""
    k_cache, v_cache = kv_cache
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    bs = meta.block_size
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        first_query = seq_len - (end - start)
        first_key = max(0, first_query - window + 1)
        first_block = first_key // bs
        blocks = meta.block_tables[i, first_block : num_blocks_for(seq_len, bs)]
        base = first_block * bs  # position of the first gathered key
        k = gather_context(k_cache, blocks, seq_len - base, q.dtype)  # [S, Hkv, D]
        v = gather_context(v_cache, blocks, seq_len - base, q.dtype)
        query_pos = torch.arange(first_query, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(base, seq_len, device=q.device)[None, :]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - window)  # [Tq, S]
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, Tq, D]
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=visible,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attended.transpose(0, 1)
    return out


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence at a time, in float32: gather, repeat KV heads, mask, softmax. For tests."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        num_blocks = num_blocks_for(seq_len, meta.block_size)
        blocks = meta.block_tables[i, :num_blocks]
        row = k_cache.shape[3]
        k = kv_format.decode(k_cache[blocks].reshape(-1, num_kv_heads, row)[:seq_len])  # [S, Hkv, D]
        v = kv_format.decode(v_cache[blocks].reshape(-1, num_kv_heads, row)[:seq_len])  # [S, Hkv, D]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, Hq, D]
        scores = torch.einsum("thd,shd->hts", q[start:end].float(), k) * scale  # [Hq, Tq, S]
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [Tq, S]
        if window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)  # [Tq, Hq, D]
    return out


def paged_attention(
    q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    """``q [num_tokens, num_heads, head_dim]`` against the paged cache ``kv_cache`` (this layer's K and V) ->
    ``[num_tokens, num_heads, head_dim]``.

    The new tokens' K/V must already be in the cache (:func:`write_kv`). ``window``: a sliding window (key ``j``
    visible to query ``i`` when ``i - window < j <= i``). While every sequence is within it the window changes
    nothing and the fast paths run; past it, the step goes through :func:`paged_attention_windowed`.
    """
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows but the metadata describes {meta.num_tokens} tokens")
    if window is not None and max(meta.seq_lens, default=0) > window:
        return paged_attention_windowed(q, kv_cache, meta, scale, window)
    if meta.plan is None:
        raise ValueError("the metadata has no attention plan: build it with the model's backend (plan)")
    return meta.plan.attend(q, kv_cache, meta, scale)
