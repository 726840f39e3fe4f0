"""The Responses API's store: what ``store: true`` keeps so that ``previous_response_id`` can continue a
conversation and ``GET /v1/responses/{id}`` can return it. In memory, bounded in count and in bytes (the
oldest entries are evicted first; every eviction is counted for ``/metrics``), thread-safe. Torch-free.

An entry keeps the response object as it was sent and the conversation it ended: the input items of the
whole chain (the previous responses' included) followed by this response's output items, so a continuation
prepends them to its own input. A response's ``instructions`` are not carried into the next one (OpenAI's
rule), so they are not part of the conversation.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as the client received it
    conversation: list[dict[str, Any]]  # input items of the chain, then this response's output items
    num_bytes: int


class ResponseStore:
    """At most ``max_count`` responses and ``max_bytes`` of them (their JSON size); oldest evicted first."""

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError("the response store's caps must be >= 0")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_bytes = 0
        self.num_evicted = 0  # over the server's life (a counter)
        self.num_refused = 0  # responses larger than max_bytes on their own: never stored
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (evicting the oldest as needed); False when it alone exceeds ``max_bytes``."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        entry = StoredResponse(response, conversation, size)
        with self._lock:
            if size > self.max_bytes or self.max_count == 0:
                self.num_refused += 1
                return False
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self._num_bytes -= old.num_bytes
            while self._entries and (
                len(self._entries) >= self.max_count or self._num_bytes + size > self.max_bytes
            ):
                _, evicted = self._entries.popitem(last=False)
                self._num_bytes -= evicted.num_bytes
                self.num_evicted += 1
            self._entries[response["id"]] = entry
            self._num_bytes += size
            return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is None:
                return False
            self._num_bytes -= entry.num_bytes
            return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes
