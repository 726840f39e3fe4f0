"""The prefix cache's disk tier on the torch side: full KV blocks copied out of the runner's tensors to files
(``cache/disk_store.py``) and back.

After each step the engine hands :meth:`KVOffloader.offload` the blocks the prefix cache registered in it (full,
written, named by their chained hash): their K and V of every layer are copied at once (the next step may
overwrite a block) into one buffer per block, and a writer thread writes them, so the engine never waits on the
disk. Before each step :meth:`KVOffloader.promote` walks the requests about to be admitted: a prefix block the
memory tier lacks but the disk holds is read, checked, copied into a free block and registered in the memory tier
(``KVCacheManager.promote_prefix``), where the scheduler then finds it as any cached block. A file that fails its
check is deleted and its block computed. Writes queue up to ``max_pending_bytes``; past that a block is dropped
(counted), so a slow disk costs cache hits, not memory.

The blocks' files hold the KV exactly as computed (the dtype of the KV tensors), so a block read back is the one
written: a restarted server answers a long prompt it has seen with the same tokens, without computing it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Iterable
from typing import Any

import torch

from tokenmill.cache.disk_store import DiskBlockStore, store_key

logger = logging.getLogger("tokenmill")

DEFAULT_MAX_PENDING_BYTES = 512 << 20


class KVOffloader:
    def __init__(
        self,
        store: DiskBlockStore,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.store, self.kv_caches = store, kv_caches
        k0 = kv_caches[0][0]
        self._block_shape = (2 * len(kv_caches), *k0.shape[1:])  # [2L, block_size, kv heads, head dim]
        self.block_bytes = int(torch.Size(self._block_shape).numel()) * k0.element_size()
        self._dtype = k0.dtype
        self.max_pending_bytes = max_pending_bytes
        self.num_dropped_writes = 0  # blocks not written: the queue was full
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self._walked: set[str] = set()  # waiting requests whose prefix the disk was asked for
        self._writer = threading.Thread(target=self._write_loop, name="tokenmill-kv-disk", daemon=True)
        self._writer.start()

    # --- memory -> disk -----------------------------------------------------------------------------
    def offload(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copy these (block, hash) pairs' KV now and queue them for the writer (blocks already on disk: skipped).
        A failure here costs the disk those blocks (counted), never the step."""
        try:
            self._offload(blocks)
        except Exception:
            self.num_dropped_writes += len(blocks)
            logger.exception("KV disk tier: copying %d blocks failed; they are not written", len(blocks))

    def _offload(self, blocks: list[tuple[int, bytes]]) -> None:
        blocks = [(b, h) for b, h in blocks if h not in self.store]
        if not blocks:
            return
        with self._pending_lock:
            room = max(0, (self.max_pending_bytes - self._pending_bytes) // self.block_bytes)
        if room < len(blocks):
            self.num_dropped_writes += len(blocks) - room
            blocks = blocks[:room]  # a chain's head first: the part most likely to be asked for again
        if not blocks:
            return
        ids = torch.tensor([b for b, _ in blocks], dtype=torch.long)
        # [n, 2L, block_size, kv heads, head dim]: one copy out of the pool's tensors
        gathered = torch.stack([t.index_select(0, ids) for kv in self.kv_caches for t in kv], dim=1)
        raw = gathered.contiguous().view(torch.uint8).reshape(len(blocks), -1).numpy()
        with self._pending_lock:
            self._pending_bytes += len(blocks) * self.block_bytes
        for (_, block_hash), row in zip(blocks, raw):
            self._queue.put((block_hash, row.tobytes()))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            block_hash, payload = item
            try:
                self.store.write(block_hash, payload)
            except Exception:  # the writer must outlive any one block
                logger.exception("KV disk tier: writing a block failed")
            finally:
                with self._pending_lock:
                    self._pending_bytes -= len(payload)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written (tests, and a clean shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=10)

    # --- disk -> memory -----------------------------------------------------------------------------
    def load(self, block: int, block_hash: bytes) -> bool:
        """Fill ``block`` of the pool's tensors from the disk's copy of ``block_hash``; False if it has no good one."""
        payload = self.store.read(block_hash, self.block_bytes)
        if payload is None:
            return False
        values = torch.frombuffer(payload, dtype=torch.uint8).view(self._dtype).view(self._block_shape)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block].copy_(values[2 * layer])
            v[block].copy_(values[2 * layer + 1])
        return True

    def promote(self, kv_manager: Any, waiting: Iterable[Any], room: int) -> int:
        """Bring back the disk's blocks of the prefixes of the first ``room`` waiting requests, each once while it
        waits (``KVCacheManager.promote_prefix``). A failure costs that request its disk hits, never the step."""
        num_promoted = 0
        for request in itertools.islice(waiting, max(0, room)):
            if request.request_id in self._walked:
                continue
            self._walked.add(request.request_id)
            try:
                num_promoted += kv_manager.promote_prefix(request, self.load)
            except Exception:
                logger.exception(
                    "KV disk tier: reading %s's prefix failed; it is computed", request.request_id
                )
        if len(self._walked) > 4096:  # requests admitted or gone: keep only those still waiting
            self._walked &= {r.request_id for r in waiting}
        return num_promoted

    def count_into(self, stats: Any, block_size: int) -> None:
        """The tier's counts into the engine's ``EngineStats`` (``/metrics``)."""
        s = self.store.stats
        stats.num_disk_queried_tokens = (s.num_hits + s.num_misses) * block_size
        stats.num_disk_hit_tokens = s.num_hits * block_size
        stats.num_disk_stored_blocks = s.num_stored
        stats.num_disk_evicted_blocks = s.num_evicted
        stats.num_disk_corrupt_blocks = s.num_corrupt
        stats.num_disk_failed_writes = s.num_failed_writes + self.num_dropped_writes


def disk_folder_key(
    model_identity: str, arithmetic: str | None, kv_cache: torch.Tensor, block_size: int
) -> str:
    """The folder of one model's blocks: its file, arithmetic, KV dtype and block shape."""
    return store_key(model_identity, arithmetic, str(kv_cache.dtype), block_size, tuple(kv_cache.shape[1:]))


def model_identity(source: str) -> str:
    """A model's file (or directory of files) by path, sizes and modification times: a re-pulled or edited model
    gets new blocks (``gguf_loader.file_identity``'s key, over every file of a directory)."""
    import hashlib
    from pathlib import Path

    from tokenmill.model.gguf_loader import file_identity

    path = Path(source)
    if path.is_dir():
        names = sorted(p for p in path.rglob("*") if p.is_file())
        return hashlib.sha256("\0".join(file_identity(p) for p in names).encode()).hexdigest()[:32]
    return file_identity(path) if path.exists() else source


def build_offloader(
    config: Any, loaded: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> KVOffloader:
    """The engine's disk tier: ``config.kv_cache_disk_dir`` (default ``<cache>/kv``), one folder per model,
    arithmetic, KV dtype and block shape, bounded by ``config.kv_cache_disk_bytes``."""
    from pathlib import Path

    from tokenmill.model.gguf_loader import default_cache_dir

    root = Path(config.kv_cache_disk_dir) if config.kv_cache_disk_dir else default_cache_dir() / "kv"
    key = disk_folder_key(
        model_identity(loaded.source), loaded.quantization, kv_caches[0][0], config.block_size
    )
    store = DiskBlockStore(root / key, config.kv_cache_disk_bytes)
    logger.info(
        "KV disk tier: %s, %d blocks (%.1f MB) of at most %.1f GB",
        store.folder, store.num_blocks, store.num_bytes / 1e6, store.max_bytes / 1e9,
    )  # fmt: skip
    return KVOffloader(store, kv_caches)
