"""BlockPool: allocate / free, reverse-order return, reference counts, None when full, integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.cache.block_pool import BlockPool


def test_allocate_and_free_counts() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert all(pool.ref_count(b) == 1 for b in a)
    pool.check_integrity()
    pool.free(a)
    assert pool.num_free_blocks == 8
    assert all(pool.ref_count(b) == 0 for b in a)
    pool.check_integrity()


def test_allocate_returns_none_when_it_does_not_fit() -> None:
    pool = BlockPool(4)
    assert pool.allocate(5) is None
    assert pool.num_free_blocks == 4  # nothing taken
    assert pool.allocate(4) is not None
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_negative_allocate_is_a_bug() -> None:
    with pytest.raises(ValueError):
        BlockPool(2).allocate(-1)


def test_free_returns_blocks_in_reverse_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(3)  # [3, 4, 5]
    assert a is not None and b is not None
    pool.free(a)
    pool.free(b)
    # The tail of each request comes back first, so a front-of-queue eviction takes tails first.
    assert pool.allocate(6) == [2, 1, 0, 5, 4, 3]


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a is not None
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)
    pool.check_integrity()
    c = pool.allocate(1)
    assert c is not None
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([c[0], c[0]])  # twice in one call
    assert pool.ref_count(c[0]) == 1
    pool.check_integrity()


def test_unknown_block_raises() -> None:
    with pytest.raises(RuntimeError, match="unknown block"):
        BlockPool(2).free([5])


def test_shared_block_is_freed_by_its_last_owner() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    assert a is not None
    pool.incref(a[:1])
    assert pool.ref_count(a[0]) == 2
    pool.free(a)
    assert pool.num_free_blocks == 2  # a[0] still owned once
    assert pool.ref_count(a[0]) == 1
    pool.check_integrity()
    pool.free(a[:1])
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.incref(a[:1])


def test_integrity_detects_corruption() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert a is not None
    pool._ref_counts[a[0]] = 0  # leaked: neither free nor owned
    with pytest.raises(RuntimeError, match="leaked"):
        pool.check_integrity()
    pool._ref_counts[a[0]] = 1
    pool._free[a[0]] = None  # free and owned
    with pytest.raises(RuntimeError):
        pool.check_integrity()


def test_bad_size() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_random_allocate_free_keeps_integrity(num_blocks: int, ops: list[tuple[bool, int]]) -> None:
    pool = BlockPool(num_blocks)
    held: list[list[int]] = []
    for do_alloc, n in ops:
        if do_alloc or not held:
            free_before = pool.num_free_blocks
            got = pool.allocate(n)
            assert (got is None) == (n > free_before)
            if got is not None:
                assert len(got) == n
                held.append(got)
        else:
            pool.free(held.pop(n % len(held)))
        pool.check_integrity()
        assert pool.num_free_blocks + sum(map(len, held)) == num_blocks
    for h in held:
        pool.free(h)
    assert pool.num_free_blocks == num_blocks
    pool.check_integrity()
