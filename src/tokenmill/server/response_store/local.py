"""The memory and SQLite backends of the Responses store, and the contract every backend keeps."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("tokenmill.server")

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 64 << 20
SQLITE_FILE = "responses.sqlite3"
BUSY_TIMEOUT_S = 10.0


class ResponseStoreError(RuntimeError):
    """The store failed (its file, its disk, its server): a clear message, never a wrong response."""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as the client received it
    conversation: list[dict[str, Any]]  # input items of the chain, then this response's output items
    num_bytes: int


def _encode(response: dict[str, Any], conversation: list[dict[str, Any]]) -> bytes:
    return json.dumps({"response": response, "conversation": conversation}, ensure_ascii=False).encode()


def _decode(response_id: str, data: bytes) -> StoredResponse:
    entry = json.loads(data)
    if entry["response"].get("id") != response_id:  # never hand out another response than the one asked for
        raise ResponseStoreError(f"the stored entry for {response_id!r} holds another response")
    return StoredResponse(entry["response"], entry["conversation"], len(data))


class ResponseStore:
    """The contract, and the memory backend: at most ``max_count`` responses and ``max_bytes`` of them (their
    encoded JSON); oldest evicted first."""

    kind = "memory"

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError("the response store's caps must be >= 0")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.num_evicted = 0  # over this process's life (a counter)
        self.num_refused = 0  # responses larger than max_bytes on their own: never stored
        self.num_failed = 0  # writes the backend failed (a full disk, a lost server)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()  # id -> (owner, encoded)
        self._num_bytes = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], owner: str = "") -> bool:
        """Keep ``response`` for ``owner`` (evicting the oldest as needed); False when it alone exceeds
        ``max_bytes`` or the backend failed to write it (logged and counted: the answer itself stands)."""
        data = _encode(response, conversation)
        if len(data) > self.max_bytes or self.max_count == 0:
            with self._lock:
                self.num_refused += 1
            return False
        try:
            self.num_evicted += self._put(response["id"], owner, data)
        except ResponseStoreError as exc:
            logger.error("the response store did not keep %s: %s", response["id"], exc)
            self.num_failed += 1
            return False
        return True

    def get(self, response_id: str, owner: str = "") -> StoredResponse | None:
        """The entry, or None when there is none or ``owner`` did not store it."""
        found = self._get(response_id)
        if found is None or found[0] != owner:
            return None
        return _decode(response_id, found[1])

    def delete(self, response_id: str, owner: str = "") -> bool:
        found = self._get(response_id)
        if found is None or found[0] != owner:
            return False
        return self._delete(response_id)

    # --- the backend ---------------------------------------------------------------------------------------
    def _put(self, response_id: str, owner: str, data: bytes) -> int:
        """Store, evicting oldest first; the number evicted."""
        num_evicted = 0
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._num_bytes -= len(old[1])
            while self._entries and (
                len(self._entries) >= self.max_count or self._num_bytes + len(data) > self.max_bytes
            ):
                _, (_, evicted) = self._entries.popitem(last=False)
                self._num_bytes -= len(evicted)
                num_evicted += 1
            self._entries[response_id] = (owner, data)
            self._num_bytes += len(data)
        return num_evicted

    def _get(self, response_id: str) -> tuple[str, bytes] | None:
        with self._lock:
            return self._entries.get(response_id)

    def _delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is None:
                return False
            self._num_bytes -= len(entry[1])
            return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def close(self) -> None:
        pass


class SqliteResponseStore(ResponseStore):
    """The store in a SQLite file, shared by the processes that open it."""

    kind = "sqlite"
    _SCHEMA = (
        "CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, "
        "owner TEXT NOT NULL, num_bytes INTEGER NOT NULL, body BLOB NOT NULL)"
    )

    def __init__(
        self, path: str | Path, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        super().__init__(max_count, max_bytes)
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            (check,) = self._db.execute("PRAGMA quick_check").fetchone()
            if check != "ok":
                raise sqlite3.DatabaseError(check)
            self._db.execute(self._SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise ValueError(
                f"the response store {self.path} cannot be used ({exc}): move the file away, or choose another "
                "with --response-store sqlite:PATH (or memory)"
            ) from None

    def _sql(self, statement: str, *args: Any) -> list[Any]:
        try:
            with self._lock:
                return self._db.execute(statement, args).fetchall()
        except sqlite3.Error as exc:
            raise ResponseStoreError(f"{self.path}: {exc}") from None

    def _put(self, response_id: str, owner: str, data: bytes) -> int:
        try:
            with self._lock:
                db = self._db
                db.execute("BEGIN IMMEDIATE")
                try:
                    db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                    count, total = db.execute(
                        "SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses"
                    ).fetchone()
                    doomed: list[int] = []
                    for seq, size in db.execute("SELECT seq, num_bytes FROM responses ORDER BY seq"):
                        if count < self.max_count and total + len(data) <= self.max_bytes:
                            break
                        doomed.append(seq)
                        count, total = count - 1, total - size
                    db.executemany("DELETE FROM responses WHERE seq = ?", [(s,) for s in doomed])
                    db.execute(
                        "INSERT INTO responses (id, owner, num_bytes, body) VALUES (?, ?, ?, ?)",
                        (response_id, owner, len(data), data),
                    )
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            return len(doomed)
        except sqlite3.Error as exc:
            raise ResponseStoreError(f"{self.path}: {exc}") from None

    def _get(self, response_id: str) -> tuple[str, bytes] | None:
        rows = self._sql("SELECT owner, body FROM responses WHERE id = ?", response_id)
        return (rows[0][0], bytes(rows[0][1])) if rows else None

    def _delete(self, response_id: str) -> bool:
        before = len(self)
        self._sql("DELETE FROM responses WHERE id = ?", response_id)
        return len(self) < before

    def __len__(self) -> int:
        return int(self._sql("SELECT COUNT(*) FROM responses")[0][0])

    @property
    def num_bytes(self) -> int:
        return int(self._sql("SELECT COALESCE(SUM(num_bytes), 0) FROM responses")[0][0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
