"""Paged attention: the fast path against the per-sequence reference, the reference against dense SDPA."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model import attention, backend, backends, kv_format
from tokenmill.model.attention import AttentionMetadata, paged_attention, paged_attention_reference, write_kv
from tokenmill.model.backend import TorchBackend
from tokenmill.model.cpu import backend as cpu_backend
from tokenmill.model.cpu.backend import CpuKernelBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
KV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
SCALE = HEAD_DIM**-0.5


def _random_step(
    rng: random.Random,
    query_lens: list[int],
    prefix_lens: list[int],
    block_size: int,
    num_blocks: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    planner: TorchBackend | None = None,
    kv_dtype: torch.dtype | None = None,
):
    """Caches (in ``kv_dtype``, default ``dtype``) holding random prefixes, random new q/k/v, and metadata over
    shuffled block tables, planned by ``planner`` (default: plain torch on ``device``)."""
    seq_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for seq_len in seq_lens:
        num_needed = -(-seq_len // block_size) + rng.randint(0, 2)  # sometimes allocated ahead
        tables.append([free.pop() for _ in range(num_needed)])
    kv_dtype = kv_dtype or dtype
    k_cache = kv_format.encode(
        torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM).to(device), kv_dtype
    )
    v_cache = kv_format.encode(
        torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM).to(device), kv_dtype
    )
    meta = (planner or TorchBackend(device)).plan(query_lens, seq_lens, tables, block_size)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM).to(device, dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(device, dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM).to(device, dtype)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k_cache, v_cache, meta


def test_build_slot_mapping_and_padding() -> None:
    meta = TorchBackend("cpu").plan([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    # seq 0: new tokens at positions 3, 4 -> block 7 offset 3, block 2 offset 0; seq 1: position 2 in block 4
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert meta.query_start_loc == [0, 2, 3]
    assert meta.block_tables.tolist() == [[7, 2], [4, 0]]
    assert [b.token_rows.tolist() for b in meta.plan.decode_buckets] == [[2]]
    assert [(p.start, p.end, p.seq_len) for p in meta.plan.prefills] == [(0, 2, 5)]


def test_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([3], [2], [[0]], block_size=4, device="cpu")
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4, device="cpu")


def test_write_kv_lands_in_slots() -> None:
    k_cache = torch.zeros(3, 4, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    write_kv(k_cache, v_cache, k, v, torch.tensor([9, 2]))
    torch.testing.assert_close(k_cache[2, 1], k[0])
    torch.testing.assert_close(v_cache[0, 2], v[1])
    assert k_cache.abs().sum() == k.abs().sum()


@pytest.mark.parametrize("seed", range(12))
def test_fast_matches_reference_on_random_mixes(seed: int) -> None:
    _check_random_mix(seed, "cpu", torch.float32, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_cpp_decode_kernel_matches_reference(kernel_variant, seed: int) -> None:
    _check_random_mix(seed, "cpu", torch.float32, atol=1e-5, planner=CpuKernelBackend(HEAD_DIM))


@pytest.mark.parametrize("seed", range(6))
def test_cpp_decode_kernel_without_the_tiled_prefill_matches_reference(kernel_variant, seed: int) -> None:
    planner = CpuKernelBackend(HEAD_DIM, tiled_prefill=False)
    _check_random_mix(seed, "cpu", torch.float32, atol=1e-5, planner=planner)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES[1:])
@pytest.mark.parametrize("seed", range(3))
def test_every_path_reads_16_and_8_bit_caches_as_the_reference(kernel_variant, kv_dtype, seed: int) -> None:
    """Random mixes of decode rows and prefills over a 16- or 8-bit cache, written by write_kv: plain torch, the
    C++ kernels and the C++ decode rows without the tiled prefill all attend the values the reference decodes."""
    for planner in (None, CpuKernelBackend(HEAD_DIM), CpuKernelBackend(HEAD_DIM, tiled_prefill=False)):
        _check_random_mix(seed, "cpu", torch.float32, atol=1e-5, planner=planner, kv_dtype=kv_dtype)


def test_cpp_decode_kernel_on_a_wide_batch(kernel_variant) -> None:
    rng = random.Random(11)
    lens = [rng.randint(0, 400) for _ in range(64)]
    q, k_cache, v_cache, meta = _random_step(
        rng, [1] * 64, lens, 16, 64 * 28, planner=CpuKernelBackend(HEAD_DIM)
    )
    assert meta.plan.decode_rows is not None and meta.plan.decode_only
    expected = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(
        paged_attention(q, (k_cache, v_cache), meta, SCALE), expected, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),  # SmolLM2: the register kernel, 3 query heads per KV head
        (10, 2, 64, 5),  # 5 per KV head: a chunk of 4 and a chunk of 1; blocks not a multiple of 4 tokens
        (8, 2, 128, 16),  # Llama-3.2-1B's head size: chunks of 2 heads
        (6, 6, 128, 7),  # no grouping
        (4, 2, 80, 16),  # a head size without a register kernel: the generic loop
    ],
)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cpp_decode_kernel_head_shapes(
    kernel_variant, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> None:
    """The kernel's head-size specialisations against a direct softmax(q k^T) v over each row's gathered cache, in
    float64 over the values the cache holds (a 16- or 8-bit cache's elements are read exactly, int8 codes times
    their row's scale)."""
    kernel = kernel_variant.paged_decode
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lens = [1, 2, 3, 4, 5, 17, 31, 64, 129, 300]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    k_cache = kv_format.encode(
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), kv_dtype
    )
    v_cache = kv_format.encode(
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), kv_dtype
    )
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen) * 2  # sharper softmax than unit scale
    scale = head_dim**-0.5
    out = kernel(q, k_cache, v_cache, tables, torch.tensor(lens), scale)
    assert out.dtype == torch.float32
    group = num_heads // num_kv_heads
    k_values, v_values = kv_format.decode(k_cache, torch.float64), kv_format.decode(v_cache, torch.float64)
    for b, seq_len in enumerate(lens):
        k = k_values[tables[b]].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        v = v_values[tables[b]].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,thd->ht", q[b].double(), k.double()) * scale).softmax(dim=-1)  # [Hq, S]
        expected = torch.einsum("ht,thd->hd", probs, v.double()).float()  # [Hq, D]
        torch.testing.assert_close(out[b], expected, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fast_matches_reference_on_cuda(dtype: torch.dtype, atol: float) -> None:
    for seed in range(4):
        _check_random_mix(seed, "cuda", dtype, atol)


_PREFILL_SHAPES = [(9, 3, 64, 16), (10, 2, 64, 5), (8, 2, 128, 16), (6, 6, 128, 7), (4, 1, 96, 16)]


def _prefill_params() -> list[Any]:
    """Every shape on an fp32 cache; on the other cache types (the same tiles after the copy out of the cache) two
    shapes by default, one per head size, and the rest with the slow tests."""
    params = []
    for kv_dtype in KV_DTYPES:
        for i, shape in enumerate(_PREFILL_SHAPES):
            slow = kv_dtype != torch.float32 and i not in (0, 3)
            case = (*shape, kv_dtype)
            params.append(pytest.param(case, marks=pytest.mark.slow) if slow else case)
    return params


@pytest.fixture(scope="module", params=_prefill_params(), ids=lambda p: "-".join(map(str, p)))
def prefill_case(request: pytest.FixtureRequest) -> _PrefillCase:
    """One shape and cache type's inputs and float64 reference, shared by every kernel variant's test (pytest
    runs a module-scoped parameter's tests together and drops the case when the next one starts)."""
    return _prefill_case(*request.param)


def test_cpp_prefill_tiles_match_a_float64_causal_softmax(
    kernel_variant: ModuleType, prefill_case: _PrefillCase
) -> None:
    """The tiled prefill kernel: tiles of 64 tokens, prompts with and without a cached prefix, longer than the
    one-token-per-row route takes, a row block straddling tokens, keys past a row's position masked; rows of
    other sequences left untouched."""
    from tokenmill.model.cpu.kernels import paged_prefill_kernel

    case = prefill_case
    head_dim = case.q.shape[-1]
    kernel = paged_prefill_kernel(head_dim)
    assert (kernel is None) == (head_dim % kernel_variant.panel_width() != 0)  # 80 on AVX-512: torch's path
    if kernel is None:
        return
    out = torch.full_like(case.q, 7.0)
    kernel(out, case.q, case.k_cache, case.v_cache, case.tables, case.rows, head_dim**-0.5)
    assert (out[:5] == 7.0).all()
    for (start, query_len, _, _), expected in zip(case.rows.tolist(), case.expected):
        torch.testing.assert_close(out[start : start + query_len], expected, atol=2e-5, rtol=1e-5)


class _PrefillCase(NamedTuple):
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    rows: torch.Tensor  # [start, query tokens, cached prefix, table index]
    expected: list[torch.Tensor]  # each sequence's rows in float64 arithmetic, rounded to float32


def _prefill_case(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> _PrefillCase:
    """The prefill kernel's inputs and their float64 causal softmax, computed once for every kernel variant."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    seqs = [
        (2, 0),
        (30, 0),
        (64, 0),
        (65, 10),
        (200, 70),
        (3, 129),
        (600, 0),
        (1100, 0),  # past one key block of the kernel (1,024 keys) inside the prompt
        (70, 2500),  # three key blocks, the query tokens in the last
    ]  # (query tokens, cached prefix)
    max_blocks = -(-max(q + p for q, p in seqs) // block_size)
    num_blocks = len(seqs) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: len(seqs) * max_blocks].view(len(seqs), max_blocks)
    k_cache = kv_format.encode(
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), kv_dtype
    )
    v_cache = kv_format.encode(
        torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen), kv_dtype
    )
    num_tokens = sum(q for q, _ in seqs) + 5  # 5 rows belong to nobody here
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen) * 2  # sharper softmax than unit scale
    rows, start = [], 5
    for i, (query_len, prefix) in enumerate(seqs):
        rows.append([start, query_len, prefix, i])
        start += query_len
    scale = head_dim**-0.5
    expected = []
    group = num_heads // num_kv_heads
    k_values, v_values = kv_format.decode(k_cache, torch.float64), kv_format.decode(v_cache, torch.float64)
    for (start, query_len, prefix, i), _ in zip(rows, seqs):
        seq_len = prefix + query_len
        k = k_values[tables[i]].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        v = v_values[tables[i]].reshape(-1, num_kv_heads, head_dim)[:seq_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[start : start + query_len].double(), k.double()) * scale
        visible = torch.arange(seq_len)[None, :] <= torch.arange(prefix, seq_len)[:, None]  # [Tq, S]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)  # [Hq, Tq, S]
        expected.append(torch.einsum("hts,shd->thd", probs, v.double()).float())  # [Tq, Hq, D]
    return _PrefillCase(q, k_cache, v_cache, tables, torch.tensor(rows), expected)


def _check_random_mix(
    seed: int,
    device: str,
    dtype: torch.dtype,
    atol: float,
    planner: TorchBackend | None = None,
    kv_dtype: torch.dtype | None = None,
) -> None:
    """A random batch of decode rows, fresh prefills and prefills after a cached prefix."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size = rng.choice([1, 4, 16])
    num_seqs = rng.randint(1, 40)
    query_lens, prefix_lens = [], []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "decode", "fresh", "prefix"])
        if kind == "decode":
            query_lens.append(1)
            prefix_lens.append(rng.randint(0, 80))
        elif kind == "fresh":
            query_lens.append(rng.randint(2, 300 if seed % 4 == 0 else 40))
            prefix_lens.append(0)
        else:
            query_lens.append(rng.randint(2, 40))
            prefix_lens.append(rng.randint(1, 60))
    num_blocks = sum(-(-(q + p) // block_size) + 2 for q, p in zip(query_lens, prefix_lens)) + 3
    q, k_cache, v_cache, meta = _random_step(
        rng, query_lens, prefix_lens, block_size, num_blocks, device, dtype, planner, kv_dtype
    )
    expected = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(
        paged_attention(q, (k_cache, v_cache), meta, SCALE), expected, atol=atol, rtol=0
    )


def test_cpp_kernel_takes_short_prefills_and_leaves_long_ones_to_matmuls(kernel_variant) -> None:
    rng = random.Random(5)
    long_len = cpu_backend.KERNEL_PREFILL_MAX_LEN + 37
    query_lens, prefix_lens = [1, 30, long_len, 12, 1], [40, 0, 0, 25, 3]
    planner = CpuKernelBackend(
        HEAD_DIM, tiled_prefill=False
    )  # as for a head size the tiled kernel does not take
    q, k_cache, v_cache, meta = _random_step(rng, query_lens, prefix_lens, 16, 80, planner=planner)
    assert meta.plan.prefill_rows is not None and meta.plan.prefill_rows.token_rows.numel() == 30 + 12
    assert [seq.end - seq.start for seq in meta.plan.prefills] == [long_len]
    expected = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(
        paged_attention(q, (k_cache, v_cache), meta, SCALE), expected, atol=1e-5, rtol=0
    )


def test_the_backend_is_chosen_once_by_device_and_dtype(kernel_variant) -> None:
    """fp32 on CPU takes the kernels; another dtype plain torch, whose plan then serves every layer as it is."""
    assert isinstance(backends.select_backend("cpu", torch.float32, HEAD_DIM), CpuKernelBackend)
    chosen = backends.select_backend("cpu", torch.bfloat16, HEAD_DIM)
    assert type(chosen) is TorchBackend
    rng = random.Random(6)
    q, k_cache, v_cache, meta = _random_step(
        rng, [1, 20, 1, 7], [30, 0, 9, 14], 16, 20, dtype=torch.bfloat16, planner=chosen
    )
    assert meta.ops is None and len(meta.plan.prefills) == 2 and len(meta.plan.decode_buckets) == 1
    expected = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
    got = paged_attention(q, (k_cache, v_cache), meta, SCALE)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=0)


def test_many_decode_rows_use_several_buckets() -> None:
    rng = random.Random(7)
    lens = [rng.randint(0, 400) for _ in range(64)]
    q, k_cache, v_cache, meta = _random_step(rng, [1] * 64, lens, 16, 64 * 28)
    assert len(meta.plan.decode_buckets) == 4
    expected = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
    torch.testing.assert_close(
        paged_attention(q, (k_cache, v_cache), meta, SCALE), expected, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("prefix_len", [0, 37])
def test_prefill_sdpa_path_matches_chunked(prefix_len: int) -> None:
    """The CUDA prefill path (SDPA) and the CPU one (chunked matmuls) agree; both run on CPU here."""
    rng = random.Random(prefix_len)
    q, k_cache, v_cache, meta = _random_step(rng, [300], [prefix_len], 8, 60)
    (seq,) = meta.plan.prefills
    k = attention.gather_context(k_cache, seq.block_ids, seq.seq_len)
    v = attention.gather_context(v_cache, seq.block_ids, seq.seq_len)
    torch.testing.assert_close(
        backend._prefill_sdpa(q, k, v, seq, SCALE),
        backend._prefill_chunked(q, k, v, seq, SCALE),
        atol=1e-5,
        rtol=0,
    )


def test_reference_matches_dense_causal_sdpa() -> None:
    """One contiguous sequence, no paging: the reference equals plain causal attention."""
    torch.manual_seed(0)
    seq_len, block_size = 45, 8
    q = torch.randn(seq_len, NUM_HEADS, HEAD_DIM)
    k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
    num_blocks = -(-seq_len // block_size)
    k_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    meta = TorchBackend("cpu").plan([seq_len], [seq_len], [list(range(num_blocks))], block_size)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    group = NUM_HEADS // NUM_KV_HEADS
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1),  # [Hq, T, D]
        k.repeat_interleave(group, dim=1).transpose(0, 1),  # [Hq, T, D]
        v.repeat_interleave(group, dim=1).transpose(0, 1),
        is_causal=True,
        scale=SCALE,
    ).transpose(0, 1)  # [T, Hq, D]
    torch.testing.assert_close(
        paged_attention_reference(q, k_cache, v_cache, meta, SCALE), dense, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window_matches_the_reference_mask(window: int) -> None:
    """Decode rows, a prefill after a cached prefix and a fresh prefill, some past the window: each query
    sees keys i - window < j <= i, as the float32 reference masks them."""
    rng = random.Random(window)
    q, k_cache, v_cache, meta = _random_step(rng, [1, 9, 20, 1], [40, 12, 0, 3], block_size=4, num_blocks=64)
    got = paged_attention(q, (k_cache, v_cache), meta, SCALE, window=window)
    expected = paged_attention_reference(q, k_cache, v_cache, meta, SCALE, window=window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if window < 40:  # the window changed the answer: the check can fail
        full = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
        assert (full - expected).abs().max() > 1e-3
