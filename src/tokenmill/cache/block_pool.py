"""The physical KV block pool: a free queue and a reference count per block. Pure Python, no torch.

A block is *free* (reference count 0, in the free queue) or *in use* (count >= 1, owned by that many
block tables; prefix caching will let several requests share one block). ``allocate`` takes blocks from
the front of the free queue; ``free`` decrements counts and appends blocks whose count reaches 0 to the
back, in reverse order, so that when a later policy evicts cached blocks from the front, the tail of a
request goes first (its prefix is the part most likely to be shared)::

    free queue:  front [ oldest free ... newest free ] back
    free([7, 8, 9]) appends 9, 8, 7 to the back; allocate(n) pops n from the front
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (reference count 1 each); ``None`` if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        block_ids = [self._free.popleft() for _ in range(n)]
        for b in block_ids:
            self._ref_counts[b] = 1
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
        """Drop one owner from each block; blocks nobody owns go back to the free queue, last one first.

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
                self._free.append(b)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless the free queue and the reference counts agree."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise RuntimeError("a block appears twice in the free queue")
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

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise RuntimeError(f"unknown block id {block_id} (pool has {self.num_blocks})")
