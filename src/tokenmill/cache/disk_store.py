"""The prefix cache's disk tier: full KV blocks kept in files named by their chained block hash. Pure Python, no torch.

A block's hash (``KVCacheManager``'s SHA-256 chained from the request's ``cache_salt``) names a file in a folder
of its own per model, arithmetic, KV dtype and block shape (:func:`store_key`), so two models, two dtypes or two
salts never read each other's blocks. A file is a header (magic, format version, payload length, CRC-32 of the
payload) and the payload: the block's K and V of every layer, as the model runner lays them out. A file is
written to a temporary name and renamed into place, so a reader sees a whole file or none; one whose length or
checksum does not match (truncated, corrupted, half-written by a crash) is deleted and reported as a miss, never
served. The folder is bounded by ``max_bytes``: the least recently used files go first (their modification time
is their last use, so the order survives a restart). A write that fails (a full disk) is counted and dropped:
the memory tier and the request go on.

Several engines may share a folder (replicas on one machine): names are content hashes and writes atomic, so
the worst a race costs is one block written twice. Each store keeps its own byte count from a scan at start, and
a store that starts deletes only temporaries too old to belong to a live writer.

Thread-safe: the engine thread reads, a writer thread writes (``worker/kv_offload.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

_MAGIC = b"TMKV"
_VERSION = 1
_HEADER = struct.Struct("<4sIQI")  # magic, version, payload bytes, crc32
_SUFFIX = ".kv"
_STALE_TEMPORARY_S = 600  # a block's write takes milliseconds; a temporary this old belongs to a dead writer


def store_key(*parts: object) -> str:
    """A folder name for the blocks of one model, arithmetic, KV dtype and block shape: a short digest of them."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


@dataclass
class DiskStoreStats:
    """Counts since start (vLLM's KV-offloading names in ``/metrics``: hits, misses, stored, evicted)."""

    num_hits: int = 0  # blocks read back
    num_misses: int = 0  # lookups past the memory tier that found no usable file
    num_corrupt: int = 0  # files refused by their length or checksum (deleted, recomputed)
    num_stored: int = 0  # blocks written
    num_evicted: int = 0  # files removed to stay under max_bytes
    num_failed_writes: int = 0  # writes the file system refused (a full disk)
    bytes_read: int = 0
    bytes_written: int = 0


class DiskBlockStore:
    def __init__(self, folder: str | Path, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(
                f"the KV disk tier's bound must be a positive number of bytes, got {max_bytes!r}"
            )
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.stats = DiskStoreStats()
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._num_bytes = 0
        self._scan()

    # --- the index ------------------------------------------------------------------------------
    def _scan(self) -> None:
        entries = []
        for path in self.folder.glob(f"*{_SUFFIX}"):
            try:
                block_hash = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((st.st_mtime_ns, block_hash, st.st_size))
        for _, block_hash, size in sorted(entries):
            self._files[block_hash] = size
            self._num_bytes += size
        with self._lock:
            self._evict_to(self.max_bytes)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Delete what writers that died mid-write left. Another live engine may be writing into this folder
        right now, so only a temporary older than any write takes is stale: a fresh one may be in flight."""
        cutoff_ns = time.time_ns() - _STALE_TEMPORARY_S * 1_000_000_000
        for path in self.folder.glob("*.tmp*"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime_ns < cutoff_ns:
                    path.unlink(missing_ok=True)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._files

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}{_SUFFIX}"

    def _forget(self, block_hash: bytes) -> None:
        size = self._files.pop(block_hash, None)
        if size is not None:
            self._num_bytes -= size

    def _evict_to(self, limit: int) -> None:
        while self._files and self._num_bytes > limit:
            block_hash, _ = next(iter(self._files.items()))
            self._forget(block_hash)
            self._path(block_hash).unlink(missing_ok=True)
            self.stats.num_evicted += 1

    # --- reads and writes -----------------------------------------------------------------------
    def read(self, block_hash: bytes, num_bytes: int) -> memoryview | None:
        """The payload of ``block_hash`` if a whole, uncorrupted file of ``num_bytes`` holds it; else None (a
        bad file is deleted)."""
        with self._lock:
            known = block_hash in self._files
        if not known:
            self.stats.num_misses += 1
            return None
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:  # into a writable buffer: the caller's tensor views it without a copy
                raw = bytearray(os.fstat(f.fileno()).st_size)
                num_read = f.readinto(raw)
        except FileNotFoundError:  # evicted since the lookup (by this store's writer, or another process)
            with self._lock:
                self._forget(block_hash)
            self.stats.num_misses += 1
            return None
        except OSError:
            raw, num_read = bytearray(), 0
        payload = _unpack(memoryview(raw)[:num_read], num_bytes)
        with self._lock:
            if payload is None:
                self._forget(block_hash)
                path.unlink(missing_ok=True)
                self.stats.num_corrupt += 1
                self.stats.num_misses += 1
                return None
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(path)  # its last use, for the order after a restart
        self.stats.num_hits += 1
        self.stats.bytes_read += payload.nbytes
        return payload

    def write(self, block_hash: bytes, payload: bytes | memoryview) -> bool:
        """Store one block (a no-op if it is there); False when the file system refused it (counted)."""
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return True
        size = _HEADER.size + memoryview(payload).nbytes
        if size > self.max_bytes:
            return False
        header = _HEADER.pack(_MAGIC, _VERSION, size - _HEADER.size, zlib.crc32(payload))
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
        try:
            with self._lock:
                self._evict_to(self.max_bytes - size)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            self.stats.num_failed_writes += 1
            return False
        with self._lock:
            self._forget(block_hash)
            self._files[block_hash] = size
            self._num_bytes += size
            self._evict_to(self.max_bytes)
        self.stats.num_stored += 1
        self.stats.bytes_written += size - _HEADER.size
        return True


def _unpack(raw: memoryview, num_bytes: int) -> memoryview | None:
    if len(raw) < _HEADER.size:
        return None
    magic, version, length, crc = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size :]  # a view: no copy
    if magic != _MAGIC or version != _VERSION or length != num_bytes or len(payload) != length:
        return None
    if zlib.crc32(payload) != crc:
        return None
    return payload
