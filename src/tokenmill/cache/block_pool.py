"""The physical KV block pool: a free queue, a reference count per block, and the prefix cache's hash map.
Pure Python, no torch.

A block is *in use* (reference count >= 1: owned by that many block tables; with prefix caching several
requests share the full blocks of a common prefix) or has count 0 and sits in the free queue. A free block
may still be *cached*: it holds the KV of a full block whose hash is in the map, and a request with that
prefix takes it back out of the queue (:meth:`touch`) instead of computing it again. ``allocate`` pops from
the front of the queue and *evicts* a cached block it pops (drops its hash). ``free`` appends blocks whose
count reaches 0 to the back, in reverse order, so the least recently used go first and, within a request,
the tail of its chain before its head (the head is the part most likely to be shared again)::

    free queue:  front [ oldest free ... newest free ] back
    free([7, 8, 9]) appends 9, 8, 7 to the back; allocate(n) pops n from the front

The queue is an insertion-ordered dict, so taking a cached block out of its middle is O(1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered: front first
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # prefix-cache hash -> block holding that full block's KV
        self._hash_of: dict[int, bytes] = {}  # the reverse map
        self.num_evicted_blocks = 0  # cached blocks reused for something else

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones, cached or not."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (reference count 1 each), evicting cached ones; ``None`` if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        block_ids = []
        for _ in range(n):
            b = next(iter(self._free))
            del self._free[b]
            self._evict(b)
            self._ref_counts[b] = 1
            block_ids.append(b)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add an owner to blocks already in use (sharing). Raises RuntimeError for a free block."""
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if self._ref_counts[b] == 0:
                raise RuntimeError(f"incref of free block {b}")
        for b in block_ids:
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one owner from each block; blocks nobody owns go back to the free queue, last one first
        (a cached block keeps its hash there until an allocation evicts it).

        Validates everything before changing anything: freeing a block more often than it is owned
        (a double free) raises RuntimeError and leaves the pool as it was.
        """
        block_ids = list(block_ids)
        for b, n in Counter(block_ids).items():
            self._check_id(b)
            if self._ref_counts[b] < n:
                raise RuntimeError(
                    f"double free of block {b}: freed {n} time(s) with reference count {self._ref_counts[b]}"
                )
        for b in reversed(block_ids):
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    # --- the prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this full block's KV, in use or free, or None."""
        return self._block_of.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add an owner to cached blocks found by :meth:`lookup`: a free one leaves the free queue."""
        block_ids = list(block_ids)
        for b in block_ids:
            self._check_id(b)
            if b not in self._hash_of:
                raise RuntimeError(f"touch of block {b}, which is not cached")
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Map a full, written, in-use block under its hash. False (nothing changes) when another block
        already holds that hash (two requests computed the same prefix at once) or this one is mapped."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"cache of free block {block_id}")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
            self.num_evicted_blocks += 1

    def check_integrity(self) -> None:
        """Raise RuntimeError unless the free queue, the reference counts and the hash map agree."""
        free_set = set(self._free)
        if not all(0 <= b < self.num_blocks for b in free_set):
            raise RuntimeError("the free queue holds an unknown block id")
        num_used = 0
        for b, count in enumerate(self._ref_counts):
            if count < 0:
                raise RuntimeError(f"block {b} has negative reference count {count}")
            if b in free_set and count != 0:
                raise RuntimeError(f"block {b} is free and owned (reference count {count})")
            if b not in free_set:
                if count == 0:
                    raise RuntimeError(f"block {b} is neither free nor owned (leaked)")
                num_used += 1
        if num_used + len(free_set) != self.num_blocks:
            raise RuntimeError(f"free ({len(free_set)}) + in use ({num_used}) != total ({self.num_blocks})")
        if len(self._block_of) != len(self._hash_of):
            raise RuntimeError("the hash map and its reverse differ in size")
        for block_hash, b in self._block_of.items():
            if self._hash_of.get(b) != block_hash:
                raise RuntimeError(f"block {b} is mapped under a hash it does not hold")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise RuntimeError(f"unknown block id {block_id} (pool has {self.num_blocks})")
