"""uvicorn's h11 protocol with the limits a public server needs: a deadline for a request's headers, and
431 (OpenAI-shaped JSON) for headers past the size limit instead of uvicorn's plain-text 400.

uvicorn bounds an idle keep-alive connection but not one that opens and then sends its headers a byte at a
time: 1,000 such connections held 1,009 file descriptors for as long as the clients liked. Here every
connection must finish its request line and headers within ``header_timeout_s`` of opening (or of its last
response, on keep-alive), or it is closed. The body has its own deadline (``read_json_body``).

Connections are counted as they open, before a byte of the request is read and so before the API key is
checked: past ``max_connections`` in all, or ``max_connections_per_client`` from one client address, a new
connection is answered 503 in OpenAI's JSON shape and closed. One client holding a thousand half-open
connections then costs itself its own limit, not everyone else's service (uvicorn's ``limit_concurrency``
counts every connection together and answers in plain text).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 * 1024


def protocol_class(
    header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = 0, max_connections_per_client: int = 0
) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` (0: no limit); the header size limit is the
    Config's ``h11_max_incomplete_event_size``. Each class counts its own server's connections."""
    return type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {
            "header_timeout_s": header_timeout_s,
            "max_connections": max_connections,
            "max_connections_per_client": max_connections_per_client,
            "open_by_client": {},
        },
    )


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers and JSON errors (400, 431)."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = 0
    max_connections_per_client = 0
    open_by_client: dict[str, int] = {}  # this server's open connections by client address (all under "")
    _header_timer: asyncio.TimerHandle | None = None
    _counted_as: str | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        client = self.client[0] if self.client else "unknown"
        counts = self.open_by_client
        if self.max_connections and counts.get("", 0) >= self.max_connections:
            self._refuse_connection(f"the server holds its maximum of {self.max_connections} connections")
            return
        if self.max_connections_per_client and counts.get(client, 0) >= self.max_connections_per_client:
            self._refuse_connection(
                f"this client holds the server's maximum of {self.max_connections_per_client} connections from one "
                "address; close some first"
            )
            return
        counts[client] = counts.get(client, 0) + 1
        counts[""] = counts.get("", 0) + 1
        self._counted_as = client
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._release()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._counted_as is not None:
            counts = self.open_by_client
            for key in (self._counted_as, ""):
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]
            self._counted_as = None

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The connection becomes a WebSocket's (the Responses API's WebSocket mode): it stays counted until the
        WebSocket protocol that takes the transport over loses it."""
        self._disarm_header_timer()
        super().handle_websocket_upgrade(event)
        socket = self.transport.get_protocol()
        lost = socket.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            self._release()
            lost(exc)

        socket.connection_lost = connection_lost  # type: ignore[method-assign]

    def _refuse_connection(self, message: str) -> None:
        self.transport.write(
            _json_error_response(
                503, "Service Unavailable", message, kind="server_error", code="too_many_connections",
                extra_headers=[(b"retry-after", b"1")],
            )
        )  # fmt: skip
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm_header_timer()  # the headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request's cycle at once
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()  # the next request on this connection gets the same deadline

    def send_400_response(self, msg: str) -> None:
        buffered = len(self.conn.trailing_data[0])
        if buffered >= self.conn._max_incomplete_event_size:  # h11 gave up on headers this large
            self._send_json_error(431, "Request Header Fields Too Large", "request headers are too large")
            return
        self._send_json_error(400, "Bad Request", f"invalid HTTP request: {msg}")

    def _send_json_error(self, status: int, reason: str, message: str) -> None:
        self.transport.write(_json_error_response(status, reason, message))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def _json_error_response(
    status: int,
    reason: str,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """A whole HTTP response with an OpenAI-shaped JSON error, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    conn = h11.Connection(h11.SERVER)  # the client's connection is in h11's error state: start clean
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn.next_event()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *(extra_headers or []),
    ]
    out = conn.send(h11.Response(status_code=status, headers=headers, reason=reason.encode()))
    return (out or b"") + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
