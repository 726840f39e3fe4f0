"""OpenAI's Responses API over a WebSocket (its "WebSocket mode"): ``GET /v1/responses`` upgraded.

The client sends ``{"type": "response.create", ...}`` messages, each a ``POST /v1/responses`` body without
``stream`` (a socket always streams) or ``background``; the server answers each with the same events the HTTP
stream sends (``response.created`` ... ``response.completed``), one JSON message each, and an ``error`` event
(``code``, ``message``, ``param``) for a request it refuses. Turns run one after another on a socket. A response
made with ``store: false`` is kept on its socket only (the last ``MAX_REMEMBERED``), so the next turn can name
it in ``previous_response_id`` and send only its new items: Codex CLI works so, and tries this transport first.
The API key is checked at the handshake (``ApiKeyMiddleware``); the connection counts against the per-client
limit while it is open (``http_protocol``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter
from starlette.websockets import WebSocket, WebSocketDisconnect

from tokenmill.server.common import ApiError, check_model, check_task, get_state, parse_body, parse_json
from tokenmill.server.protocol_responses import ResponsesRequest
from tokenmill.server.respond import events
from tokenmill.server.routes_responses import begin_response

router = APIRouter()
logger = logging.getLogger("tokenmill.server")

MAX_REMEMBERED = 16  # store-less responses a socket keeps for its own continuations


class _Remembered(OrderedDict[str, list[dict[str, Any]]]):
    def keep(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self[response_id] = conversation
        while len(self) > MAX_REMEMBERED:
            self.popitem(last=False)


@router.websocket("/v1/responses")
async def responses_socket(ws: WebSocket) -> None:
    await ws.accept()
    remembered = _Remembered()
    sequence_number = 0
    try:
        while True:
            raw = await ws.receive_text()
            try:
                async with contextlib.aclosing(_turn(ws, raw, remembered)) as turn:
                    async for event in turn:
                        await ws.send_text(event)
            except ApiError as exc:
                logger.info("%s (WebSocket) -> %d%s: %s", ws.url.path, exc.status_code,
                            f" ({exc.info.param})" if exc.info.param else "", exc.info.message)  # fmt: skip
                error = {"type": "error", "code": exc.info.code or exc.info.type, "message": exc.info.message,
                         "param": exc.info.param, "sequence_number": sequence_number}  # fmt: skip
                sequence_number += 1
                await ws.send_text(json.dumps(error))
    except WebSocketDisconnect:
        return


async def _turn(ws: WebSocket, raw: str, remembered: _Remembered) -> Any:
    """One ``response.create``: its events' JSON texts, in order. ApiError for one refused."""
    state = get_state(ws)
    data = raw.encode("utf-8", "surrogatepass")
    if len(data) > state.max_body_bytes:
        raise ApiError(413, f"the message exceeds {state.max_body_bytes} bytes", code="request_too_large")
    body = parse_json(data)
    if not isinstance(body, dict) or body.get("type") != "response.create":
        kind = body.get("type") if isinstance(body, dict) else None
        raise ApiError.bad_request(
            f"type: a client event must be 'response.create', got {kind!r}",
            param="type",
            code="invalid_event",
        )
    body = {k: v for k, v in body.items() if k != "type"}
    if body.get("stream") is False:
        raise ApiError.bad_request("stream: a WebSocket always streams", param="stream")
    req = parse_body(ResponsesRequest, {**body, "stream": True})
    check_model(state, req.model)
    check_task(state, "generate")
    view, group = await begin_response(ws, state, req, remembered)
    view.remember = remembered.keep
    ended = False
    try:
        async for text in events(view, group, state):
            data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            for payload in data:  # a keep-alive comment carries none: the socket has its own pings
                yield payload
        ended = True
    finally:
        if not ended:  # the socket went away mid-turn: its request stops
            group.abort()
