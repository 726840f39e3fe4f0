"""The Responses API's store: what ``store: true`` keeps so that ``previous_response_id`` can continue a
conversation and ``GET /v1/responses/{id}`` can return it. Torch-free, thread-safe.

Three backends, one contract (:class:`ResponseStore`): bounded in count and in bytes, the oldest evicted first
(every eviction counted for ``/metrics``), each entry readable and deletable only by the owner that stored it
(the API key it came with; ``""`` when the server has none):

- ``sqlite`` (the default: ``responses.sqlite3`` in the cache directory): survives a restart, and the
  processes on one machine (Ray Serve replicas) share it. WAL mode, each write one ``BEGIN IMMEDIATE``
  transaction (concurrent writers queue on SQLite's lock, with a busy timeout), a file that is not a sound
  database refused at start with the way out named.
- ``redis://host:port/db``: replicas on several machines share one Redis (the ``redis`` package); a put and
  its evictions are one Lua script, so concurrent writers never split them.
- ``memory``: per process, lost at exit; the entries are kept as encoded JSON, so the byte bound is what
  they cost (a dict of them would cost several times as much).

An entry keeps the response object as it was sent and the conversation it ended: the input items of the
whole chain (the previous responses' included) followed by this response's output items, so a continuation
prepends them to its own input. A response's ``instructions`` are not carried into the next one (OpenAI's
rule), so they are not part of the conversation. ``store: false`` is kept nowhere.
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.server.response_store.local import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_COUNT,
    SQLITE_FILE,
    ResponseStore,
    ResponseStoreError,
    SqliteResponseStore,
    StoredResponse,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_COUNT",
    "ResponseStore",
    "ResponseStoreError",
    "SqliteResponseStore",
    "StoredResponse",
    "open_response_store",
]


def open_response_store(
    spec: str,
    max_count: int = DEFAULT_MAX_COUNT,
    max_bytes: int = DEFAULT_MAX_BYTES,
    cache_dir: Path | None = None,
) -> ResponseStore:
    """The store ``spec`` names: ``memory``, ``sqlite`` (in ``cache_dir``), ``sqlite:PATH`` or
    ``redis://...``; ValueError for anything else or a store that cannot be opened."""
    if spec == "memory":
        return ResponseStore(max_count, max_bytes)
    if spec == "sqlite" or spec.startswith("sqlite:"):
        path = spec.removeprefix("sqlite").removeprefix(":")
        if not path:
            if cache_dir is None:
                raise ValueError("--response-store sqlite needs a cache directory (or sqlite:PATH)")
            path = str(cache_dir / SQLITE_FILE)
        return SqliteResponseStore(path, max_count, max_bytes)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from tokenmill.server.response_store.redis_store import RedisResponseStore

        return RedisResponseStore(spec, max_count, max_bytes)
    raise ValueError(f"--response-store must be memory, sqlite, sqlite:PATH or redis://..., got {spec!r}")
