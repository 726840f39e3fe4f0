"""The prefix cache in the pure-Python cache layer: hashed full blocks, sharing, LRU eviction tail first,
salts, and the scheduler counting a cached prefix as computed. No torch."""

from __future__ import annotations

import hashlib
import struct

import pytest

from tokenmill.cache.block_pool import BlockPool
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SampledToken
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], max_tokens: int = 4, **kw: object) -> Request:
    salt = kw.pop("cache_salt", None)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw), cache_salt=salt)  # type: ignore[arg-type]


def manager(num_blocks: int = 16, reserve: str = "none") -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BS, num_blocks=num_blocks), reserve, enable_caching=True)  # type: ignore[arg-type]


def test_block_hash_is_sha256_chained_over_parent_and_tokens() -> None:
    m = manager()
    r = req("a", list(range(10)))
    root = hashlib.sha256(b"").digest()
    h0 = hashlib.sha256(root + struct.pack("<4i", 0, 1, 2, 3)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4i", 4, 5, 6, 7)).digest()
    assert m._block_hashes(r, 2) == [h0, h1]
    salted = req("b", list(range(10)), cache_salt="tenant-1")
    assert m._block_hashes(salted, 1) != [h0]


def _prefill(m: KVCacheManager, r: Request) -> None:
    """Allocate and 'compute' the whole prompt, as a step would, then register its full blocks."""
    cached = m.find_cached_prefix(r)
    r.num_computed_tokens = len(cached) * BS
    assert m.allocate_slots(r, r.num_tokens - r.num_computed_tokens, cached_blocks=cached) is not None
    r.num_computed_tokens = r.num_tokens
    m.cache_full_blocks(r)


@pytest.mark.parametrize(("prompt_len", "num_hit_blocks"), [(8, 1), (9, 2), (7, 1), (4, 0), (12, 2), (13, 3)])
def test_hits_full_blocks_only_and_never_the_last_token(prompt_len: int, num_hit_blocks: int) -> None:
    """A 12-token prompt is cached (3 blocks); a second prompt sharing its first prompt_len tokens finds
    the full blocks of that shared part, but never its own last token's block."""
    m = manager()
    a = req("a", list(range(12)))
    _prefill(m, a)
    b = req("b", list(range(prompt_len)))
    found = m.find_cached_prefix(b)
    assert len(found) == num_hit_blocks
    assert found == a.block_ids[:num_hit_blocks]
    m.check_integrity()


def test_shared_blocks_are_released_not_freed_and_evicted_lru_tail_first() -> None:
    m = manager(num_blocks=6)
    a = req("a", list(range(12)))
    _prefill(m, a)  # 3 blocks, all cached
    b = req("b", list(range(12)) + [99])
    _prefill(m, b)  # shares a's 3 blocks, one private
    assert b.block_ids[:3] == a.block_ids and m.pool.ref_count(a.block_ids[0]) == 2
    m.free(a)
    assert a.block_ids == [] and m.pool.ref_count(b.block_ids[0]) == 1  # b still holds them
    shared = b.block_ids[:3]
    m.free(b)  # everything back: free, the 3 shared ones still cached (evictable)
    assert m.pool.num_free_blocks == 6 and m.pool.num_cached_blocks == 3
    m.check_integrity()
    # New, unrelated requests take the never-cached blocks first, then evict the tail of the chain first.
    c = req("c", [500 + i for i in range(16)])  # 4 blocks: the 2 never used, b's private one, then one cached
    assert m.allocate_slots(c, 16) is not None
    assert m.pool.num_evicted_blocks == 1 and m.pool.is_cached(shared[0]) and m.pool.is_cached(shared[1])
    assert not m.pool.is_cached(shared[2])
    m.check_integrity()


def test_salt_keeps_tenants_apart() -> None:
    m = manager()
    _prefill(m, req("a", list(range(12)), cache_salt="alice"))
    assert m.find_cached_prefix(req("b", list(range(12)), cache_salt="bob")) == []
    assert len(m.find_cached_prefix(req("c", list(range(12)), cache_salt="alice"))) == 2


def test_pool_touch_cache_and_integrity() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1) or []
    assert pool.cache(b, b"h") and not pool.cache(b, b"h2") and pool.lookup(b"h") == b
    pool.free([b])
    assert pool.num_free_blocks == 4 and pool.lookup(b"h") == b  # evictable, still found
    pool.touch([b])
    assert pool.num_free_blocks == 3 and pool.ref_count(b) == 1
    pool.check_integrity()
    pool._hash_of[b] = b"other"  # mapped under a hash it does not hold
    with pytest.raises(RuntimeError, match="does not hold"):
        pool.check_integrity()


def _scheduler(num_blocks: int = 32, budget: int = 64) -> Scheduler:
    kv = manager(num_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64), kv, BS)


def _run(sched: Scheduler) -> None:
    now = 0.0
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {row.request_id: SampledToken(900 + row.seq_len) for row in out.rows if row.sample}
        now += 1
        sched.update_from_output(out, ModelRunnerOutput(sampled=sampled), now)
        sched.check_integrity()


def test_scheduler_counts_the_cached_prefix_as_computed() -> None:
    sched = _scheduler()
    first = req("first", list(range(20)), max_tokens=4)
    sched.add_request(first)
    _run(sched)
    # 20 prompt tokens + 3 written outputs = 23 computed: 5 full blocks cached, outputs' block included
    second = req("second", list(range(20)) + first.output_token_ids[:3] + [7, 7])
    sched.add_request(second)
    out = sched.schedule()
    (row,) = out.rows
    assert row.start_position == 20  # blocks 0-4 found (the answer's tokens too); 5 tokens left
    assert out.record.num_prefix_hit_tokens == 20 and out.record.num_prefix_queried_tokens == 25
    assert second.num_cached_tokens == 20
    logprobs = req("scored", list(range(20)), prompt_logprobs=1)  # needs every position: skips the cache
    sched.add_request(logprobs)
    sched.update_from_output(out, ModelRunnerOutput(sampled={"second": SampledToken(1)}), 10.0)
    out = sched.schedule()
    assert [r.start_position for r in out.rows if r.request_id == "scored"] == [0]
    _run(sched)
    assert sched.kv.num_free_blocks == 32
