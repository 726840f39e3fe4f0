"""Paged attention over a block-structured KV cache.

The cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``; a sequence's
keys live in the blocks its block table lists, token ``t`` at block ``table[t // block_size]``, offset
``t % block_size``. A step's tokens come as one flat batch; :class:`AttentionMetadata` says which rows
belong to which sequence and is built once per step, with every index tensor the layers need.

``paged_attention`` splits the rows by kind:

* decode rows (one new token) are grouped into a few buckets of similar context length; each bucket is
  one gather of its blocks and one ``scaled_dot_product_attention`` call (the query heads that share a
  KV head are the "query length" of that call, so grouped-query attention needs no repeat);
* prefill rows (several new tokens, maybe after a cached prefix) go one sequence at a time: on CUDA
  through SDPA, on CPU through query chunks of plain matmuls that skip the keys a chunk cannot see
  (faster there than the CPU SDPA kernel on long prompts).

``paged_attention_reference`` is the slow, obviously-correct version the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.model.cpu_kernels import paged_decode_kernel, paged_prefill_kernel

_MAX_DECODE_BUCKETS = 4
_ROWS_PER_DECODE_BUCKET = 16  # no more buckets than one per this many decode rows
_PREFILL_CHUNK_TOKENS = 128  # CPU prefill: queries per matmul chunk
# Without the tiled prefill kernel (a head size it does not take), CPU prefills of up to this many tokens (prefix
# included) go through the decode kernel one query token per row; longer ones through chunked matmuls, whose work
# grows better with length (benchmarks/README.md).
KERNEL_PREFILL_MAX_LEN = 512


@dataclass
class DecodeBucket:
    """Decode rows of similar context length, attended in one batched call."""

    token_rows: torch.Tensor  # [num_rows] int64: flat batch rows
    block_ids: torch.Tensor  # [num_rows * max_num_blocks] int64: each row's blocks, padded with block 0
    key_mask: torch.Tensor  # [num_rows, 1, 1, max_num_blocks * block_size] bool: True for keys in context
    max_num_blocks: int


@dataclass
class DecodeRows:
    """Rows of one query token each, for the C++ kernel that reads blocks in place (CPU, fp32): the decode rows,
    or every token of the short prefills, each over its own causal prefix."""

    token_rows: torch.Tensor  # [n] int64: flat batch rows
    block_tables: torch.Tensor  # [num_tables, max_num_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [n] int64: keys each row sees
    # [n] int64: which block table each row reads (None: row i reads table i)
    table_index: torch.Tensor | None = None


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


@dataclass
class AttentionMetadata:
    """Where every token of the flat batch belongs and where its K/V live. Build it with :meth:`build`."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]  # [num_seqs + 1]: seq i's new tokens are rows [i]:[i + 1] of this list
    seq_lens: list[int]  # [num_seqs]: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int64, padded with 0
    block_size: int
    # Precomputed once per step for paged_attention, shared by all layers.
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    decode_rows: DecodeRows | None = None  # set instead of decode_buckets when the C++ kernel is used
    prefills: list[PrefillSeq] = field(default_factory=list)
    prefill_rows: DecodeRows | None = None  # short prefills' tokens, for the C++ kernel (instead of prefills)
    # every prefill for the tiled C++ kernel, which then replaces prefill_rows and prefills (fp32, head size a
    # multiple of 32): [n, 4] int64 (first flat row, query tokens, position of the first, block table row)
    prefill_seqs: torch.Tensor | None = None
    _decode_plan: tuple[list[int], list[list[int]]] = ([], [])  # to plan buckets lazily
    _kernel_prefill_seqs: list[int] = field(default_factory=list)  # to plan them as PrefillSeq lazily

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
        use_cpp: bool | None = None,
    ) -> AttentionMetadata:
        """Sequence ``i`` computes its last ``query_lens[i]`` tokens (the rest of its context is cached).

        ``use_cpp`` (default: on CPU when the kernel builds) plans decode rows for the C++ kernel.
        """
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
        meta = cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=query_start_loc,
            seq_lens=list(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device).view(
                len(seq_lens), max_num_blocks
            ),
            block_size=block_size,
        )
        decode_seqs = [i for i, q in enumerate(query_lens) if q == 1]
        if use_cpp is None:
            use_cpp = torch.device(device).type == "cpu" and paged_decode_kernel() is not None
        if use_cpp and decode_seqs:
            meta.decode_rows = DecodeRows(
                token_rows=torch.tensor([query_start_loc[i] for i in decode_seqs], dtype=torch.int64),
                block_tables=meta.block_tables[decode_seqs],
                seq_lens=torch.tensor([seq_lens[i] for i in decode_seqs], dtype=torch.int64),
            )
            meta._decode_plan = (decode_seqs, block_tables)
        else:
            meta.decode_buckets = _plan_decode_buckets(decode_seqs, meta, block_tables, device)
        prefill_seqs = [i for i, q in enumerate(query_lens) if q > 1]
        if use_cpp:
            meta._kernel_prefill_seqs = [i for i in prefill_seqs if seq_lens[i] <= KERNEL_PREFILL_MAX_LEN]
        if meta._kernel_prefill_seqs:
            rows, lens, tables = [], [], []
            for i in meta._kernel_prefill_seqs:
                first_pos = seq_lens[i] - query_lens[i]
                rows.extend(range(query_start_loc[i], query_start_loc[i + 1]))
                lens.extend(range(first_pos + 1, seq_lens[i] + 1))  # token at position p sees p + 1 keys
                tables.extend([i] * query_lens[i])
            meta.prefill_rows = DecodeRows(
                token_rows=torch.tensor(rows, dtype=torch.int64),
                block_tables=meta.block_tables,
                seq_lens=torch.tensor(lens, dtype=torch.int64),
                table_index=torch.tensor(tables, dtype=torch.int64),
            )

            meta._decode_plan = (meta._decode_plan[0], block_tables)
        if use_cpp and prefill_seqs:  # every prefill, for the tiled kernel where the head size allows it
            meta.prefill_seqs = torch.tensor(
                [[query_start_loc[i], query_lens[i], seq_lens[i] - query_lens[i], i] for i in prefill_seqs],
                dtype=torch.int64,
            )
        kernel_seqs = set(meta._kernel_prefill_seqs)
        meta.prefills = [
            _plan_prefill(i, meta, block_tables[i], device) for i in prefill_seqs if i not in kernel_seqs
        ]
        return meta


def _num_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def _plan_decode_buckets(
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
        max_num_blocks = _num_blocks(max(lens), bs)
        block_ids: list[int] = []
        for i, seq_len in zip(members, lens):
            used = tables[i][: _num_blocks(seq_len, bs)]
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


def _plan_prefill(
    i: int, meta: AttentionMetadata, table: list[int], device: torch.device | str
) -> PrefillSeq:
    start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
    query_len = end - start
    # Query q (absolute position seq_len - query_len + q) sees keys 0 .. seq_len - query_len + q.
    causal_mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - query_len)
    block_ids = torch.tensor(table[: _num_blocks(seq_len, meta.block_size)], dtype=torch.int64, device=device)
    return PrefillSeq(start=start, end=end, seq_len=seq_len, block_ids=block_ids, causal_mask=causal_mask)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values ``[num_tokens, num_kv_heads, head_dim]`` at their flat cache slots."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    # view (not reshape): a non-contiguous cache must fail loudly, not be written into a copy
    k_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [num_slots, Hkv, D]
    v_cache.view(num_slots, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A sequence's first ``seq_len`` cached tokens, ``[seq_len, num_kv_heads, head_dim]``."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_blocks, block_size * num_kv_heads * head_dim).index_select(0, block_ids)
    return flat.view(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]


def paged_attention_windowed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Sliding-window attention, one sequence at a time: each reads only the blocks holding keys some query of its
    can see (the window before its first new token onwards), one SDPA call with the causal-and-window mask."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
    bs = meta.block_size
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        first_query = seq_len - (end - start)
        first_key = max(0, first_query - window + 1)
        first_block = first_key // bs
        blocks = meta.block_tables[i, first_block : _num_blocks(seq_len, bs)]
        base = first_block * bs  # position of the first gathered key
        k = _gather_context(k_cache, blocks, seq_len - base)  # [S, Hkv, D]
        v = _gather_context(v_cache, blocks, seq_len - base)
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
        num_blocks = _num_blocks(seq_len, meta.block_size)
        blocks = meta.block_tables[i, :num_blocks]
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:seq_len]  # [S, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:seq_len]  # [S, Hkv, D]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).float()  # [S, Hq, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).float()  # [S, Hq, D]
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
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``q [num_tokens, num_heads, head_dim]`` against the paged cache -> ``[num_tokens, num_heads, head_dim]``.

    The new tokens' K/V must already be in the cache (:func:`write_kv`). ``window``: a sliding window (key ``j``
    visible to query ``i`` when ``i - window < j <= i``). While every sequence is within it the window changes
    nothing and the fast paths run; past it, the step goes through :func:`paged_attention_windowed`.
    """
    if q.shape[0] != meta.num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows but the metadata describes {meta.num_tokens} tokens")
    if window is not None and max(meta.seq_lens, default=0) > window:
        return paged_attention_windowed(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D], contiguous whatever q's strides
    kernel = paged_decode_kernel()
    fp32 = q.dtype == torch.float32 and k_cache.dtype == torch.float32
    row_sets, prefills = [meta.decode_rows, meta.prefill_rows], meta.prefills
    tiled = paged_prefill_kernel(q.shape[2]) if fp32 and meta.prefill_seqs is not None else None
    if tiled is not None:  # every prefill in tiles: a tile's query tokens share the keys and values they read
        tiled(out, q.contiguous(), k_cache, v_cache, meta.block_tables, meta.prefill_seqs, scale)
        row_sets, prefills = [meta.decode_rows], []
    for rows in row_sets:
        if rows is None:
            continue
        if kernel is not None and fp32:
            q_rows = q.index_select(0, rows.token_rows)  # [n, Hq, D], contiguous
            attended = kernel(
                q_rows, k_cache, v_cache, rows.block_tables, rows.seq_lens, scale, rows.table_index
            )
            out.index_copy_(0, rows.token_rows, attended)
        elif rows is meta.decode_rows:  # not fp32: plan the torch buckets after all
            meta.decode_buckets = _plan_decode_buckets(
                *meta._decode_plan[:1], meta, meta._decode_plan[1], q.device
            )
            meta.decode_rows = None
        else:  # ... and the torch prefills
            tables = meta._decode_plan[1]
            meta.prefills += [_plan_prefill(i, meta, tables[i], q.device) for i in meta._kernel_prefill_seqs]
            meta.prefill_rows, meta.prefill_seqs, meta._kernel_prefill_seqs = None, None, []
    for bucket in meta.decode_buckets:
        out.index_copy_(0, bucket.token_rows, _decode_bucket(q, k_cache, v_cache, bucket, scale))
    use_sdpa = q.device.type == "cuda"
    for seq in prefills:  # meta.prefills itself (the bf16 fallback above may have extended it), or none
        k = _gather_context(k_cache, seq.block_ids, seq.seq_len)  # [S, Hkv, D]
        v = _gather_context(v_cache, seq.block_ids, seq.seq_len)  # [S, Hkv, D]
        prefill = _prefill_sdpa if use_sdpa else _prefill_chunked
        out[seq.start : seq.end] = prefill(q[seq.start : seq.end], k, v, seq, scale)
    return out


def _decode_bucket(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket, scale: float
) -> torch.Tensor:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_rows = bucket.token_rows.shape[0]
    max_len = bucket.max_num_blocks * block_size
    group = q.shape[1] // num_kv_heads
    flat_shape = (num_blocks, block_size * num_kv_heads * head_dim)
    k = k_cache.view(flat_shape).index_select(0, bucket.block_ids)  # [n * max_blocks, bs * Hkv * D]
    v = v_cache.view(flat_shape).index_select(0, bucket.block_ids)
    k = k.view(num_rows, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, L, D]
    v = v.view(num_rows, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, L, D]
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
