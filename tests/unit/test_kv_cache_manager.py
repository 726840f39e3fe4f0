"""KVCacheManager: block tables on Request, incremental growth, worst-case reservations."""

from __future__ import annotations

import pytest

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def req(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def manager(num_blocks: int, block_size: int = 4, reserve: str = "none") -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks), reserve)  # type: ignore[arg-type]


def test_num_blocks_needed() -> None:
    m = manager(8)
    r = req("a", 5)
    assert m.num_blocks_needed(r, 5) == 2
    assert m.allocate_slots(r, 5) == [0, 1]
    r.num_computed_tokens = 5
    assert m.num_blocks_needed(r, 3) == 0  # positions 5..7 fit in block 1
    assert m.num_blocks_needed(r, 4) == 1  # position 8 needs a third block
    assert m.num_blocks_needed(r, 0) == 0


def test_grows_a_block_at_a_time() -> None:
    m = manager(8)
    r = req("a", 4, max_tokens=10)
    assert m.allocate_slots(r, 4) == [0]
    r.num_computed_tokens = 4
    assert m.allocate_slots(r, 1) == [1]  # crosses the block boundary
    assert r.block_ids == [0, 1]
    r.num_computed_tokens = 5
    for _ in range(3):
        assert m.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
    assert m.allocate_slots(r, 1) == [2]
    assert m.num_free_blocks == 5
    assert m.usage == pytest.approx(3 / 8)
    m.check_integrity()


def test_none_when_full_leaves_state_unchanged() -> None:
    m = manager(2)
    a, b = req("a", 4), req("b", 8)
    assert m.allocate_slots(a, 4) == [0]
    assert not m.can_allocate(b, 8)
    assert m.allocate_slots(b, 8) is None
    assert b.block_ids == [] and not m.owns_blocks("b")
    assert m.num_free_blocks == 1
    m.check_integrity()


def test_lookahead_is_checked_not_allocated_and_capped_at_worst_case() -> None:
    m = manager(3)
    r = req("a", 4, max_tokens=8)  # worst case 12 tokens = 3 blocks
    assert m.can_allocate(r, 4, num_lookahead_blocks=2)
    assert m.can_allocate(r, 4)
    other = req("o", 4)
    m.allocate_slots(other, 4)
    assert not m.can_allocate(r, 4, num_lookahead_blocks=2)  # 1 + 2 > 2 free
    assert m.allocate_slots(r, 4, num_lookahead_blocks=1) == [1]
    assert r.block_ids == [1] and m.num_free_blocks == 1
    # A request whose worst case is its current table needs no lookahead: it will never grow.
    small = req("s", 2, max_tokens=1)
    assert m.can_allocate(small, 2, num_lookahead_blocks=5)


def test_free_all_in_reverse_order() -> None:
    m = manager(6)
    a, b = req("a", 12), req("b", 12)
    assert m.allocate_slots(a, 12) == [0, 1, 2]
    assert m.allocate_slots(b, 12) == [3, 4, 5]
    m.free(a)
    m.free(b)
    assert a.block_ids == [] and b.block_ids == []
    assert m.pool.allocate(6) == [2, 1, 0, 5, 4, 3]


def test_free_untracked_is_a_noop_and_double_free_does_nothing() -> None:
    m = manager(4)
    r = req("a", 4)
    m.free(r)  # never allocated
    m.allocate_slots(r, 4)
    m.free(r)
    m.free(r)  # the table is empty: nothing to give back twice
    assert m.num_free_blocks == 4
    m.check_integrity()


def test_worst_case_reserves_then_draws_from_the_reservation() -> None:
    m = manager(10, reserve="worst_case")
    r = req("a", 5, max_tokens=12)  # 17 tokens -> 5 blocks of 4
    assert m.allocate_slots(r, 5) == [0, 1]
    assert r.num_reserved_blocks == 3
    assert m.num_reserved_unused_blocks == 3
    assert m.num_free_blocks == 5  # 10 - 2 used - 3 reserved
    assert m.usage == pytest.approx(0.5)
    m.check_integrity()
    # Growth comes out of the reservation: the shared free count does not move.
    r.num_computed_tokens = 5
    for pos in range(5, 16):
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens = pos + 1
        assert m.num_free_blocks == 5
        m.check_integrity()
    assert len(r.block_ids) == 4 and r.num_reserved_blocks == 1
    m.free(r)
    assert r.num_reserved_blocks == 0 and m.num_reserved_unused_blocks == 0
    assert m.num_free_blocks == 10 and m.usage == 0.0
    m.check_integrity()


def test_worst_case_admission_needs_the_whole_worst_case() -> None:
    m = manager(6, reserve="worst_case")
    big = req("big", 4, max_tokens=12)  # 16 tokens = 4 blocks
    small = req("small", 4, max_tokens=4)  # 8 tokens = 2 blocks
    assert m.allocate_slots(big, 4) == [0]
    assert m.num_free_blocks == 2
    assert m.allocate_slots(small, 4) == [1]
    assert m.num_free_blocks == 0
    late = req("late", 1, max_tokens=1)
    assert not m.can_allocate(late, 1)
    assert m.allocate_slots(late, 1) is None
    # Physically 4 blocks are free: the request would fit without the reservations.
    assert m.pool.num_free_blocks == 4
    assert m.would_fit_without_reservations(late, 1)
    m.check_integrity()


def test_none_mode_never_reserves() -> None:
    m = manager(6)
    r = req("a", 4, max_tokens=12)
    m.allocate_slots(r, 4)
    assert r.num_reserved_blocks == 0 and m.num_reserved_unused_blocks == 0


def test_integrity_detects_tampering() -> None:
    m = manager(4)
    r = req("a", 8)
    m.allocate_slots(r, 8)
    r.block_ids.append(3)  # a block the pool thinks is free
    with pytest.raises(RuntimeError):
        m.check_integrity()
    r.block_ids.pop()
    m.check_integrity()
    r.num_computed_tokens = 9  # more computed tokens than the table holds
    with pytest.raises(RuntimeError, match="cannot hold"):
        m.check_integrity()


def test_bad_reserve() -> None:
    with pytest.raises(ValueError, match="reserve"):
        manager(4, reserve="sometimes")


@pytest.mark.parametrize("caching", [False, True])
def test_sliding_window_releases_blocks_no_query_can_see(caching: bool) -> None:
    """Window 6, blocks of 4: after 13 computed tokens the next query (position 13) sees positions 8..13, so
    blocks 0 (positions 0-3) and 1 (4-7) go back; the table keeps their places as DROPPED."""
    from tokenmill.cache.kv_cache_manager import DROPPED

    m = KVCacheManager(CacheConfig(block_size=4, num_blocks=8), enable_caching=caching, sliding_window=6)
    r = req("a", 13, max_tokens=20)
    assert m.allocate_slots(r, 13) == [0, 1, 2, 3]
    r.num_computed_tokens = 13
    m.cache_full_blocks(r)
    assert m.release_outside_window(r) == 2
    assert r.block_ids == [DROPPED, DROPPED, 2, 3]
    assert m.num_free_blocks == 6
    assert m.release_outside_window(r) == 0  # nothing new
    m.check_integrity()
    new = m.allocate_slots(r, 4)
    assert new is not None and len(new) == 1 and r.block_ids[-1] == new[0]  # one more block
    r.num_computed_tokens = 17
    assert m.release_outside_window(r) == 1  # first visible now 12: block 2 (8-11) goes
    m.check_integrity()
    m.free(r)
    assert m.num_free_blocks == 8
    m.check_integrity()


def test_no_window_releases_nothing() -> None:
    m = manager(8)
    r = req("a", 13)
    m.allocate_slots(r, 13)
    r.num_computed_tokens = 13
    assert m.release_outside_window(r) == 0 and len(r.block_ids) == 4
