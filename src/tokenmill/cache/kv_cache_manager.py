"""Per-request block tables on top of the :class:`BlockPool`. Pure Python, no torch.

The manager is the only writer of ``Request.block_ids`` and ``Request.num_reserved_blocks``. It tracks
every request that holds blocks or a reservation, by id, until :meth:`KVCacheManager.free`.

Two admission policies (``reserve``):

* ``"none"`` (vLLM, nano-vllm): allocate only what the tokens of this step need, a block at a time as a
  request crosses a block boundary. The pool is never booked for text nobody generates, but a decode can
  find the pool dry, which is what preemption is for.
* ``"worst_case"`` (TGI, the seed's Day 32): the first allocation books blocks for the request's worst case,
  ``prompt + max_tokens`` tokens; later growth draws from that reservation and can never fail. Reserved
  blocks stay physically in the pool's free queue: the manager only counts them, so
  ``num_free_blocks = pool free - reserved but unused``.

Prefix caching (``enable_caching``): a full block's identity is a hash chained over its parent's hash and
its token ids, ``sha256(parent || int32 token ids)``, where the first block's parent is the sha256 of the
request's ``cache_salt`` (empty when unsalted) and, for a request with a LoRA adapter, the adapter's weights digest
(the same tokens under two adapters have different KV). SHA-256 is collision resistant, so two different token prefixes sharing a block by
accident is not a practical risk (a 64-bit hash would be, at scale). :meth:`find_cached_prefix` returns the
longest run of cached blocks at the start of a request (never its last token: one token is always computed,
so that there are logits to sample from); :meth:`allocate_slots` takes them with the first allocation;
:meth:`cache_full_blocks` registers a request's blocks once they are full and their KV is written (after
the step that filled them, prompt or generated tokens alike). Only full blocks are ever shared, and a shared
block is never written again: a request writes only past its cached prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Literal

from tokenmill.cache.block_pool import BlockPool
from tokenmill.config import CacheConfig
from tokenmill.request import Request

DROPPED = -1  # a block-table entry whose block went back to the pool (outside the sliding window)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        cache_config: CacheConfig,
        reserve: Literal["none", "worst_case"] = "none",
        enable_caching: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        if reserve not in ("none", "worst_case"):
            raise ValueError(f"reserve must be 'none' or 'worst_case', got {reserve!r}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.enable_caching = enable_caching
        # every layer attends to at most this many keys back: blocks wholly before a request's window go back
        self.sliding_window = sliding_window
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.reserve = reserve
        self.pool = BlockPool(cache_config.num_blocks)
        self._requests: dict[str, Request] = {}  # requests holding blocks or a reservation
        self._num_reserved_unused = 0  # sum of num_reserved_blocks over tracked requests
        # with a lower tier (the disk, worker/kv_offload.py): blocks registered since the last take_newly_cached
        self.record_newly_cached = False
        self._newly_cached: list[tuple[int, bytes]] = []

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks any request may take now: the pool's free blocks less the unused reservations."""
        return self.pool.num_free_blocks - self._num_reserved_unused

    @property
    def num_reserved_unused_blocks(self) -> int:
        return self._num_reserved_unused

    @property
    def usage(self) -> float:
        """Fraction of the pool in use or booked by a reservation."""
        return (self.pool.num_used_blocks + self._num_reserved_unused) / self.num_blocks

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    def owns_blocks(self, request_id: str) -> bool:
        return request_id in self._requests

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def max_blocks(self, request: Request) -> int:
        """Blocks the request's worst case (``prompt + max_tokens``) covers: what worst-case admission books."""
        return self.blocks_for_tokens(request.max_num_tokens)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks for the table to cover ``num_computed_tokens + num_new_tokens`` token slots.

        ::

            token slots: 0                  num_computed     num_computed + num_new
                         |<--- computed --->|<---- new ---->|
            block table: [ block 0 ][ block 1 ][ block 2 ]  [ needed ][ lookahead ] [ reserved ]
                         |<---- len(block_ids) blocks ---->|  (allocated) (free only)  (worst_case)

        ``allocate_slots`` allocates the *needed* blocks; *lookahead* blocks must only be free;
        under ``worst_case`` the request's *reserved* blocks are booked for it and drawn first.
        """
        total = request.num_computed_tokens + num_new_tokens
        return max(0, self.blocks_for_tokens(total) - len(request.block_ids))

    def _demand(self, request: Request, num_new_tokens: int, num_lookahead_blocks: int) -> tuple[int, int]:
        """(blocks to allocate now, blocks to take out of the shared free count in all)."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        # Lookahead (room to keep going after this step) never reaches past the worst case: a request
        # admitted under add_request's "fits in the whole pool" check must always fit in an empty pool.
        table_after = len(request.block_ids) + needed
        lookahead = max(0, min(num_lookahead_blocks, self.max_blocks(request) - table_after))
        if self.reserve == "worst_case" and request.request_id not in self._requests:
            # First allocation: book the whole worst case (or more, if asked for more), less the cached
            # prefix blocks the table starts with.
            total = max(self.max_blocks(request) - len(request.block_ids), needed + lookahead)
            return needed, total
        # Later growth draws on the request's own reservation before the shared free blocks.
        return needed, max(0, needed + lookahead - request.num_reserved_blocks)

    def can_allocate(self, request: Request, num_new_tokens: int, num_lookahead_blocks: int = 0) -> bool:
        _, shared = self._demand(request, num_new_tokens, num_lookahead_blocks)
        return shared <= self.num_free_blocks

    def would_fit_without_reservations(
        self, request: Request, num_new_tokens: int, num_lookahead_blocks: int = 0
    ) -> bool:
        """Whether the blocks these tokens need (no worst-case booking) fit in every block nobody writes.

        Tells a pool held by worst-case reservations (``IdleReason.KV_RESERVED``) from a full one.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        table_after = len(request.block_ids) + needed
        lookahead = max(0, min(num_lookahead_blocks, self.max_blocks(request) - table_after))
        return needed + lookahead <= self.pool.num_free_blocks

    # --- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_blocks: int = 0,
        cached_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Grow ``request.block_ids`` to cover ``num_computed_tokens + num_new_tokens`` token slots.

        Returns the newly added block ids (possibly none), or ``None`` when they do not fit right now,
        leaving everything unchanged. ``num_lookahead_blocks`` asks that this many more blocks be free
        too (not allocated): a preempted request is re-admitted only when it can make progress.
        ``cached_blocks`` (first allocation only, from :meth:`find_cached_prefix`, with
        ``num_computed_tokens`` already counting them) start the table; a free cached block taken counts
        against the free blocks like a new one.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        first = request.request_id not in self._requests
        if first and (request.block_ids or request.num_reserved_blocks):
            raise RuntimeError(f"request {request.request_id!r} holds blocks the manager does not track")
        cached = list(cached_blocks or [])
        if cached and not first:
            raise RuntimeError(f"request {request.request_id!r}: cached blocks only start a table")
        if cached:
            request.set_block_table(cached)  # for _demand; taken back below when they do not fit
        needed, shared = self._demand(request, num_new_tokens, num_lookahead_blocks)
        num_revived = sum(1 for b in cached if self.pool.ref_count(b) == 0)  # they leave the free queue
        if shared + num_revived > self.num_free_blocks:
            if cached:
                request.set_block_table([])
            return None
        if cached:
            self.pool.touch(cached)
            request.mark_blocks_cached(len(cached))
        if first and self.reserve == "worst_case":
            reserved_total = shared  # booked now, allocated below as it is needed
        else:
            reserved_total = request.num_reserved_blocks
        new_blocks = self.pool.allocate(needed)
        if new_blocks is None:  # cannot happen: shared <= free and reservations are in the free queue
            raise RuntimeError(
                f"pool short of blocks for {request.request_id!r} although accounting said it fits"
            )
        from_reservation = min(needed, reserved_total)
        new_reserved = reserved_total - from_reservation
        self._num_reserved_unused += new_reserved - request.num_reserved_blocks
        request.append_blocks(new_blocks, new_reserved)
        self._requests[request.request_id] = request
        return new_blocks

    def release_outside_window(self, request: Request) -> int:
        """With a sliding window on every layer: give back the request's blocks that no later query can see
        (every position in them ``< num_computed_tokens - window + 1``); their table entries become
        :data:`DROPPED`, so positions keep their block index. Returns how many were released."""
        if self.sliding_window is None or request.request_id not in self._requests:
            return 0
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        num_droppable = min(max(0, first_visible) // self.block_size, len(request.block_ids))
        released = [b for b in request.block_ids[:num_droppable] if b != DROPPED]
        if released:
            self.pool.free(released)
            request.drop_leading_blocks(num_droppable, DROPPED)
        return len(released)

    def trim_to(self, request: Request, num_tokens: int) -> int:
        """Give back the blocks wholly past the first ``num_tokens`` token slots (the slots of rejected draft
        tokens, speculative decoding). They were allocated this step and are never in the prefix cache (only
        blocks full of accepted tokens are registered). Under ``worst_case`` they go back into the request's
        reservation. Returns how many were freed."""
        if request.request_id not in self._requests:
            return 0
        num_keep = self.blocks_for_tokens(num_tokens)
        tail = request.block_ids[num_keep:]
        if not tail:
            return 0
        self.pool.free([b for b in tail if b != DROPPED])
        num_reserved = request.num_reserved_blocks
        if self.reserve == "worst_case":
            num_reserved += len(tail)
            self._num_reserved_unused += len(tail)
        request.drop_trailing_blocks(num_keep, num_reserved)
        return len(tail)

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks (tail first) and its reservation. No-op if it holds none."""
        tracked = self._requests.pop(request.request_id, None)
        if tracked is None:
            if request.block_ids or request.num_reserved_blocks:
                raise RuntimeError(f"request {request.request_id!r} holds blocks the manager does not track")
            return
        if tracked is not request:
            raise RuntimeError(f"two requests share the id {request.request_id!r}")
        self.pool.free([b for b in request.block_ids if b != DROPPED])
        self._num_reserved_unused -= request.num_reserved_blocks
        request.release_blocks()

    # --- prefix caching -----------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (extended as needed)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _root_hash(request)
            block = tokens[i * bs : (i + 1) * bs]
            request.add_block_hash(hashlib.sha256(parent + struct.pack(f"<{bs}i", *block)).digest())
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks holding the longest prefix of the request's tokens, at most all but its last
        token (empty with caching off). Nothing is taken yet: :meth:`allocate_slots` does that."""
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in self._block_hashes(request, max_blocks):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are full and written (``num_computed_tokens`` covers them)."""
        if not self.enable_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if num_full <= request.num_cached_blocks:
            return
        hashes = self._block_hashes(request, num_full)
        for i in range(request.num_cached_blocks, num_full):
            if request.block_ids[i] == DROPPED:  # released before it was registered: nothing to cache
                continue
            # False: a twin computed at once; stays private
            if self.pool.cache(request.block_ids[i], hashes[i]) and self.record_newly_cached:
                self._newly_cached.append((request.block_ids[i], hashes[i]))
        request.mark_blocks_cached(num_full)

    def take_newly_cached(self) -> list[tuple[int, bytes]]:
        """(block, hash) of every block registered since the last call, when ``record_newly_cached``: the blocks
        a lower tier copies before the next step can overwrite them."""
        out, self._newly_cached = self._newly_cached, []
        return out

    def promote_prefix(self, request: Request, load: Callable[[int, bytes], bool]) -> int:
        """Bring back from a lower tier the request's prefix blocks that the memory tier lacks.

        Walks the request's full blocks in order (never its last token, as :meth:`find_cached_prefix`): a block
        cached in memory is held; a missing one gets a free block, which ``load(block, hash)`` fills (False: the
        tier has no good copy, and the walk ends there). Then every held block goes back to the free queue,
        cached, the chain's head last (evicted last), for :meth:`find_cached_prefix` to find. Returns how many
        blocks were brought back. The free-block count is the same after as before: admission decides as usual."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        held: list[int] = []
        num_promoted = 0
        try:
            for block_hash in self._block_hashes(request, (request.num_tokens - 1) // self.block_size):
                block = self.pool.lookup(block_hash)
                if block is not None:
                    self.pool.touch([block])
                    held.append(block)
                    continue
                if self.num_free_blocks < 1:
                    break
                allocated = self.pool.allocate(1)
                assert allocated is not None  # a free block was counted
                filled = False
                try:
                    filled = load(allocated[0], block_hash)
                finally:
                    if not filled:  # a miss, or the load raised: the block goes back
                        self.pool.free(allocated)
                if not filled:
                    break
                self.pool.cache(allocated[0], block_hash)
                held.append(allocated[0])
                num_promoted += 1
        finally:
            self.pool.free(held)
        return num_promoted

    # --- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise RuntimeError unless pool, block tables and reservations agree."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        num_reserved = 0
        for request_id, request in self._requests.items():
            if request.request_id != request_id:
                raise RuntimeError(f"request tracked under {request_id!r} is {request.request_id!r}")
            if request.num_reserved_blocks < 0:
                raise RuntimeError(f"request {request_id!r} has a negative reservation")
            if len(request.block_ids) * self.block_size < request.num_computed_tokens:
                raise RuntimeError(
                    f"request {request_id!r}: {len(request.block_ids)} blocks cannot hold "
                    f"{request.num_computed_tokens} computed tokens"
                )
            num_reserved += request.num_reserved_blocks
            for b in request.block_ids:
                if b != DROPPED:
                    owners[b] = owners.get(b, 0) + 1
            if request.num_cached_blocks > len(request.block_ids):
                raise RuntimeError(f"request {request_id!r} counts more cached blocks than it holds")
            for i, b in enumerate(request.block_ids[: request.num_cached_blocks]):
                if b == DROPPED:
                    continue
                mapped = self.pool.hash_of(b)
                if mapped is not None and mapped != request.block_hashes[i]:
                    raise RuntimeError(f"request {request_id!r} holds block {b} cached for other tokens")
        if num_reserved != self._num_reserved_unused:
            raise RuntimeError(
                f"reservations sum to {num_reserved}, counter says {self._num_reserved_unused}"
            )
        if self._num_reserved_unused > self.pool.num_free_blocks:
            raise RuntimeError(
                f"{self._num_reserved_unused} blocks reserved but only {self.pool.num_free_blocks} free"
            )
        if len(owners) != self.pool.num_used_blocks:
            raise RuntimeError(
                f"{self.pool.num_used_blocks} blocks in use but {len(owners)} owned by block tables"
            )
        for b, n in owners.items():
            if self.pool.ref_count(b) != n:
                raise RuntimeError(f"block {b}: reference count {self.pool.ref_count(b)}, {n} owner(s)")


def _root_hash(request: Request) -> bytes:
    """The first block's parent: the salt's sha256, with the LoRA adapter's digest when the request has one."""
    root = (request.cache_salt or "").encode()
    if request.lora_key is not None:
        root += b"\x00lora:" + request.lora_key.encode()
    return hashlib.sha256(root).digest()
