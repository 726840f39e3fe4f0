"""The Responses store's backends against one contract: bounded by count and bytes (oldest out first, counted),
each entry readable and deletable only by its owner, a restart keeping what SQLite held, concurrent writers
from several processes never losing or mixing a response, a corrupt file refused with a clear message, a full
disk failing the write (counted) while reads go on. Redis runs against a real ``redis-server`` started here
(Debian's package), skipped where the binary is missing."""

from __future__ import annotations

import multiprocessing
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tokenmill.server.response_store import (
    ResponseStore,
    ResponseStoreError,
    SqliteResponseStore,
    open_response_store,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian's redis-server package)")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    yield url
    proc.kill()
    proc.wait()


Factory = Callable[[int, int], ResponseStore]


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    stores: list[ResponseStore] = []

    def make(max_count: int, max_bytes: int) -> ResponseStore:
        if request.param == "memory":
            store = open_response_store("memory", max_count, max_bytes)
        elif request.param == "sqlite":
            store = open_response_store(
                f"sqlite:{tmp_path / f'r{len(stores)}.sqlite3'}", max_count, max_bytes
            )
        else:
            url = request.getfixturevalue("redis_url")
            store = open_response_store(url, max_count, max_bytes)
            store._redis.flushdb()  # type: ignore[attr-defined]
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def _response(i: int | str, pad: int = 100) -> dict[str, object]:
    return {"id": f"r{i}", "pad": "x" * pad}


def test_oldest_out_first_by_count_and_by_bytes(make_store: Factory) -> None:
    store = make_store(3, 10_000)
    for i in range(5):
        assert store.put(_response(i), [{"type": "message", "i": i}])
    assert len(store) == 3 and store.num_evicted == 2
    assert store.get("r0") is None and store.get("r1") is None
    got = store.get("r4")
    assert (
        got is not None and got.response == _response(4) and got.conversation == [{"type": "message", "i": 4}]
    )
    small = make_store(100, 700)
    for i in range(4):
        small.put(_response(i, 200), [])
    assert small.num_bytes <= 700 and small.get("r3") is not None and small.get("r0") is None
    assert not small.put(_response("huge", 1000), []) and small.num_refused == 1
    assert small.delete("r3") and not small.delete("r3") and small.get("r3") is None
    before = small.num_bytes
    small.put({"id": "r2", "pad": "y"}, [])  # replacing an id does not count twice
    assert small.num_bytes < before


def test_only_the_owner_reads_or_deletes(make_store: Factory) -> None:
    store = make_store(10, 100_000)
    store.put(_response(1), [], owner="alice")
    store.put(_response(2), [])
    assert store.get("r1") is None and store.get("r1", "bob") is None
    assert store.get("r1", "alice") is not None
    assert not store.delete("r1", "bob") and store.get("r1", "alice") is not None
    assert store.delete("r1", "alice")
    assert store.get("r2") is not None and store.get("r2", "alice") is None


def test_sqlite_keeps_its_responses_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite3"
    first = SqliteResponseStore(path, 10, 1 << 20)
    first.put(_response(1), [{"role": "user", "content": "hi"}], owner="k")
    first.close()
    second = SqliteResponseStore(path, 10, 1 << 20)
    got = second.get("r1", "k")
    assert got is not None and got.conversation == [{"role": "user", "content": "hi"}]
    second.close()


def _writer(path: str, worker: int, count: int) -> None:
    store = SqliteResponseStore(path, 10_000, 1 << 30)
    for i in range(count):
        response = {"id": f"w{worker}-{i}", "worker": worker, "i": i, "pad": "z" * (i % 7) * 50}
        assert store.put(response, [{"worker": worker, "i": i}], owner=f"o{worker}")
    store.close()


def test_concurrent_writers_from_several_processes_lose_and_mix_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.sqlite3")
    SqliteResponseStore(path).close()
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(path, w, 60)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
        assert p.exitcode == 0
    store = SqliteResponseStore(path, 10_000, 1 << 30)
    assert len(store) == 240
    for w in range(4):
        for i in range(60):
            got = store.get(f"w{w}-{i}", f"o{w}")
            assert got is not None and got.response["worker"] == w and got.response["i"] == i
            assert got.conversation == [{"worker": w, "i": i}]
    store.close()


def test_a_corrupt_file_is_refused_at_start_with_the_way_out(tmp_path: Path) -> None:
    path = tmp_path / "bad.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="cannot be used.*move the file away"):
        SqliteResponseStore(path)
    truncated = tmp_path / "cut.sqlite3"
    good = SqliteResponseStore(truncated)
    for i in range(50):
        good.put(_response(i, 2000), [])
    good.close()
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 3] + b"\x00" * 4096 + data[len(data) // 2 :])
    try:
        store = SqliteResponseStore(truncated)
    except ValueError as exc:
        assert "cannot be used" in str(exc)
    else:  # a damage quick_check cannot see: reads still never return another response's body
        for i in range(50):
            try:
                got = store.get(f"r{i}")
            except (ResponseStoreError, ValueError):
                continue
            assert got is None or got.response["id"] == f"r{i}"


def test_a_full_disk_fails_the_write_and_reads_go_on(tmp_path: Path) -> None:
    store = SqliteResponseStore(tmp_path / "full.sqlite3", 100, 1 << 30)
    assert store.put(_response(1), [])
    store._db.execute(
        "PRAGMA max_page_count = 1"
    )  # the file may not grow: SQLite's "database or disk is full"
    assert not store.put(_response(2, 100_000), [])
    assert store.num_failed == 1
    got = store.get("r1")
    assert got is not None and got.response == _response(1)
    assert store.get("r2") is None


def test_redis_writers_never_split_a_put(redis_url: str) -> None:
    import threading

    store = open_response_store(redis_url, 50, 1 << 30)
    store._redis.flushdb()  # type: ignore[attr-defined]

    def write(w: int) -> None:
        other = open_response_store(redis_url, 50, 1 << 30)
        for i in range(100):
            other.put({"id": f"t{w}-{i}", "w": w}, [], owner=str(w))
        other.close()

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 50
    order = store._redis.zrange("tokenmill:responses:order", 0, -1)  # type: ignore[attr-defined]
    sizes = sum(int(store._redis.hget(f"tokenmill:responses:r:{i.decode()}", "bytes")) for i in order)  # type: ignore[attr-defined]
    assert sizes == store.num_bytes
    store.close()


def test_an_unknown_store_is_refused() -> None:
    with pytest.raises(ValueError, match="--response-store"):
        open_response_store("postgres://x")
    with pytest.raises(ValueError, match="cannot be reached"):
        open_response_store(f"redis://127.0.0.1:{_free_port()}/0")
