"""The prefix cache's disk tier, torch-free: ``cache/disk_store.py`` and ``KVCacheManager.promote_prefix``."""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

from tokenmill.cache.disk_store import DiskBlockStore, store_key
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

PAYLOAD = 1000


def _payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAYLOAD))


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_blocks_round_trip_and_survive_a_restart(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    for i in range(5):
        assert store.write(_hash(i), _payload(i))
    assert store.num_blocks == 5 and store.stats.num_stored == 5
    again = DiskBlockStore(tmp_path, 1 << 20)  # a restarted server
    assert again.num_blocks == 5 and again.num_bytes == store.num_bytes
    for i in range(5):
        assert bytes(again.read(_hash(i), PAYLOAD)) == _payload(i)
    assert again.read(_hash(9), PAYLOAD) is None
    assert (again.stats.num_hits, again.stats.num_misses) == (5, 1)


def test_least_recently_used_go_first_under_the_bound(tmp_path: Path) -> None:
    probe = DiskBlockStore(tmp_path / "probe", 1 << 20)
    probe.write(_hash(0), _payload(0))
    file_bytes = probe.num_bytes
    store = DiskBlockStore(tmp_path / "s", 3 * file_bytes)
    for i in range(3):
        store.write(_hash(i), _payload(i))
    assert store.read(_hash(0), PAYLOAD) is not None  # 0 is now the most recently used
    store.write(_hash(3), _payload(3))
    assert _hash(1) not in store and _hash(0) in store and _hash(3) in store
    assert store.num_bytes <= 3 * file_bytes and store.stats.num_evicted == 1
    assert not (tmp_path / "s" / f"{_hash(1).hex()}.kv").exists()
    # the order survives a restart (file times): the next eviction takes 2, then 0
    os.utime(tmp_path / "s" / f"{_hash(2).hex()}.kv", (1, 1))
    restarted = DiskBlockStore(tmp_path / "s", 3 * file_bytes)
    restarted.write(_hash(4), _payload(4))
    assert _hash(2) not in restarted and _hash(0) in restarted


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_length"])
def test_a_damaged_file_is_refused_deleted_and_counted(tmp_path: Path, damage: str) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    store.write(_hash(1), _payload(1))
    path = tmp_path / f"{_hash(1).hex()}.kv"
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0x10
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))
    expected = PAYLOAD + 4 if damage == "other_length" else PAYLOAD
    assert store.read(_hash(1), expected) is None
    assert not path.exists() and _hash(1) not in store
    assert store.stats.num_corrupt == 1 and store.stats.num_hits == 0


def test_a_full_disk_stops_writes_and_reads_go_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    store.write(_hash(1), _payload(1))

    def no_space(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    assert not store.write(_hash(2), _payload(2))
    assert store.stats.num_failed_writes == 1 and _hash(2) not in store
    assert not list(tmp_path.glob("*.tmp*"))  # the half-written file is gone
    assert bytes(store.read(_hash(1), PAYLOAD)) == _payload(1)


def test_concurrent_readers_and_writers_never_see_a_partial_block(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, 1 << 30)
    errors: list[str] = []

    def writer(base: int) -> None:
        for i in range(base, base + 200):
            store.write(_hash(i % 300), _payload(i % 300))

    def reader() -> None:
        for i in range(600):
            got = store.read(_hash(i % 300), PAYLOAD)
            if got is not None and bytes(got) != _payload(i % 300):
                errors.append(f"block {i % 300} read back wrong")

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 100)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and store.stats.num_corrupt == 0
    assert store.num_blocks == 300 and store.num_bytes == 300 * (store.num_bytes // store.num_blocks)


def _write_in_process(folder: str, first: int) -> None:
    store = DiskBlockStore(folder, 1 << 30)
    for i in range(first, first + 100):
        store.write(_hash(i), _payload(i))


def test_two_processes_share_a_folder(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_in_process, args=(str(tmp_path), first)) for first in (0, 50)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    store = DiskBlockStore(tmp_path, 1 << 30)
    assert store.num_blocks == 150
    assert all(bytes(store.read(_hash(i), PAYLOAD)) == _payload(i) for i in range(150))


def test_a_starting_store_leaves_a_live_writers_temporary_and_deletes_a_dead_ones(tmp_path: Path) -> None:
    live = tmp_path / f"{_hash(1).hex()}.kv.tmp4242.1"  # another engine, mid-write
    dead = tmp_path / f"{_hash(2).hex()}.kv.tmp4343.1"  # a writer that died an hour ago
    live.write_bytes(b"half")
    dead.write_bytes(b"half")
    an_hour_ago = time.time() - 3600
    os.utime(dead, (an_hour_ago, an_hour_ago))
    store = DiskBlockStore(tmp_path, 1 << 20)
    assert live.exists() and not dead.exists()
    assert store.num_blocks == 0  # neither is a block


def test_bad_bounds_and_keys() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="bound"):
            DiskBlockStore("/tmp/unused-tokenmill-store", bad)  # type: ignore[arg-type]
    assert store_key("m", "gguf-q8", "torch.float32") != store_key("m", "gguf-q8", "torch.bfloat16")


# --- promotion into the memory tier -----------------------------------------------------------------------
def _request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def _manager(num_blocks: int = 32) -> KVCacheManager:
    manager = KVCacheManager(CacheConfig(block_size=4, num_blocks=num_blocks), enable_caching=True)
    manager.record_newly_cached = True
    return manager


def test_promotion_fills_the_missing_blocks_and_admission_finds_them() -> None:
    manager = _manager()
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks before the last token
    disk: dict[bytes, str] = {}
    first = _request("a", tokens)
    manager.allocate_slots(first, len(tokens))
    first.set_num_computed(len(tokens))
    manager.cache_full_blocks(first)
    for block, block_hash in manager.take_newly_cached():
        disk[block_hash] = f"kv of block {block}"
    assert len(disk) == 4
    manager.free(first)
    fresh = _manager()  # a restart: nothing in memory
    loaded: list[tuple[int, bytes]] = []

    def load(block: int, block_hash: bytes) -> bool:
        loaded.append((block, block_hash))
        return block_hash in disk

    second = _request("b", tokens)
    assert fresh.promote_prefix(second, load) == 4
    assert fresh.num_free_blocks == 32  # still free, now cached
    found = fresh.find_cached_prefix(second)
    assert found == [b for b, _ in loaded]
    assert fresh.take_newly_cached() == []  # promoted blocks are not written back
    fresh.check_integrity()
    # another salt names other blocks: nothing to promote
    assert _manager().promote_prefix(_request("c", tokens, salt="other"), load) == 0


def test_promotion_stops_at_a_bad_block_and_keeps_memory_blocks() -> None:
    manager = _manager()
    tokens = list(range(18))
    req = _request("a", tokens)
    manager.allocate_slots(req, 8)
    req.set_num_computed(8)
    manager.cache_full_blocks(req)  # blocks 0 and 1 in memory
    manager.free(req)
    calls: list[bytes] = []

    def load(block: int, block_hash: bytes) -> bool:
        calls.append(block_hash)
        return len(calls) == 1  # block 2 comes back; block 3's copy is bad

    again = _request("b", tokens)
    assert manager.promote_prefix(again, load) == 1
    assert len(manager.find_cached_prefix(again)) == 3
    manager.check_integrity()
    assert manager.num_free_blocks == 32


def test_a_file_removed_since_the_lookup_is_a_plain_miss(tmp_path: Path) -> None:
    store = DiskBlockStore(tmp_path, 1 << 20)
    store.write(_hash(1), _payload(1))
    (tmp_path / f"{_hash(1).hex()}.kv").unlink()  # another process's eviction
    assert store.read(_hash(1), PAYLOAD) is None
    assert store.stats.num_corrupt == 0 and store.stats.num_misses == 1 and _hash(1) not in store
