"""A server's traffic as JSON lines: what ``tokenmill serve --record FILE`` writes and ``tokenmill bench replay``
reads. Pure Python, no torch.

The first line is the header, the engine's configuration when the recording began::

    {"kind": "header", "version": 1, "model": "...", "started_at": "2026-12-02T13:00:00+00:00",
     "config": {"block_size": 16, "num_kv_blocks": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
                "max_model_len": 8192, "reserve": "none", "enable_prefix_caching": true}}

then one line per engine request, written when it ends (so in order of finishing)::

    {"kind": "request", "request_id": "chatcmpl-...-0", "arrival_s": 12.5, "arrival_iteration": 431.2, "arrival_index": 97,
     "num_prompt_tokens": 230, "prefix_keys": ["9f86d081884c7d65", ...], "max_tokens": 256, "min_tokens": 0,
     "ignore_eos": false, "temperature": 0.7, "top_p": 1.0, "num_output_tokens": 61, "finish_reason": "stop",
     "num_cached_tokens": 192, "num_preemptions": 0, "time_to_first_token_s": 0.21, "e2e_s": 2.9}

``arrival_s`` counts from the recording's start, ``arrival_index`` the order the engine accepted requests in; ``arrival_iteration`` is the same instant on the engine's
iteration clock (iterations done, plus the idle time before it in mean iterations), the unit-clock replay's
arrival. ``prefix_keys`` names each full block of the prompt with 16 hex digits of a SHA-256 chained over the
blocks before it and the block's token ids (rooted in the request's cache salt): two prompts share a key exactly
when they share that whole prefix, which is what the prefix cache sees, and the text cannot be read back from it.
The prompt's text is there (``"prompt"``) only with ``--record-text``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1
KEY_HEX_DIGITS = 16
CONFIG_KEYS = (
    "block_size",
    "num_kv_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "reserve",
    "enable_prefix_caching",
)


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[str]:
    """The chained key of each full block of ``token_ids`` (never the last token's block if it is partial)."""
    keys: list[str] = []
    parent = hashlib.sha256(("salt:" + salt).encode() if salt is not None else b"").digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = ",".join(str(t) for t in token_ids[start : start + block_size]).encode()
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent.hex()[:KEY_HEX_DIGITS])
    return keys


@dataclass
class TrafficRequest:
    """One recorded engine request."""

    request_id: str
    arrival_s: float
    arrival_iteration: float
    num_prompt_tokens: int
    prefix_keys: list[str]
    max_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    arrival_index: int = 0  # the order the engine accepted requests in (its queue's order)
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_token_s: float | None = None
    e2e_s: float | None = None
    prompt: str | None = None  # the prompt's text: only with --record-text

    def to_line(self) -> str:
        body = {"kind": "request", **asdict(self)}
        if self.prompt is None:
            del body["prompt"]
        return json.dumps(body)


@dataclass
class Traffic:
    """A recording: the engine's configuration then, and its requests in order of arrival."""

    config: dict[str, Any]
    requests: list[TrafficRequest]
    model: str | None = None
    started_at: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return int(self.config["block_size"])

    @property
    def duration_s(self) -> float:
        return max((r.arrival_s for r in self.requests), default=0.0)


def header_line(config: dict[str, Any], model: str | None, started_at: str) -> str:
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"a recording's header needs the engine's {', '.join(missing)}")
    body = {"kind": "header", "version": VERSION, "model": model, "started_at": started_at}
    return json.dumps({**body, "config": {k: config[k] for k in CONFIG_KEYS}})


_REQUEST_FIELDS = set(TrafficRequest.__dataclass_fields__)


def read_traffic(path: str | Path) -> Traffic:
    with open(path, encoding="utf-8") as f:
        return parse_traffic(f, str(path))


def parse_traffic(lines: Iterable[str], source: str = "<traffic>") -> Traffic:
    """A recording from its lines; ``ValueError`` naming the line for anything malformed. A last line cut short
    (a server killed mid-write) is skipped."""
    header: dict[str, Any] | None = None
    requests: list[TrafficRequest] = []
    raw = [line for line in lines]
    for number, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(raw) and not line.endswith("\n"):
                break  # the last write was cut off
            raise ValueError(f"{source}:{number}: not JSON: {exc}") from None
        kind = body.pop("kind", None) if isinstance(body, dict) else None
        if kind == "header":
            if header is not None:
                raise ValueError(f"{source}:{number}: a second header")
            if body.get("version") != VERSION:
                raise ValueError(
                    f"{source}:{number}: version {body.get('version')!r}, this reader reads {VERSION}"
                )
            header = body
        elif kind == "request":
            if header is None:
                raise ValueError(f"{source}:{number}: a request before the header")
            unknown = set(body) - _REQUEST_FIELDS
            if unknown:
                raise ValueError(f"{source}:{number}: unknown fields {sorted(unknown)}")
            try:
                requests.append(TrafficRequest(**body))
            except TypeError as exc:
                raise ValueError(f"{source}:{number}: {exc}") from None
        else:
            raise ValueError(f"{source}:{number}: kind must be 'header' or 'request', got {kind!r}")
    if header is None:
        raise ValueError(f"{source}: no header line")
    requests.sort(key=lambda r: (r.arrival_index, r.arrival_s))
    config = header.get("config") or {}
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{source}: the header's config lacks {', '.join(missing)}")
    return Traffic(
        config=config, requests=requests, model=header.get("model"), started_at=header.get("started_at")
    )


def synthetic_prompt(
    request: TrafficRequest, block_size: int, token_range: tuple[int, int] = (1000, 10000)
) -> list[int]:
    """Token ids of the recorded prompt's length that share blocks exactly where the recorded prompts did: each
    full block drawn from a generator seeded by its key, the partial tail by the request's id."""
    lo, hi = token_range
    ids: list[int] = []
    for key in request.prefix_keys:
        rng = random.Random(key)
        ids.extend(rng.randrange(lo, hi) for _ in range(block_size))
    rng = random.Random("tail:" + request.request_id)
    ids.extend(rng.randrange(lo, hi) for _ in range(request.num_prompt_tokens - len(ids)))
    return ids
