"""What batchbench runs: a fixed set of requests, the seed's by default, or one read from a JSON-lines file.

One request per line, a JSON object with these keys::

    {"prompt": "Once upon a time", "max_tokens": 4}
    {"prompt_len": 5, "max_tokens": 32, "arrival_time_s": 0.5, "id": "straggler"}

``prompt`` (text) or ``prompt_len`` (that many synthetic token ids), exactly one of them; ``max_tokens`` (>= 1);
optional ``arrival_time_s`` (>= 0, from the start of the run; iterations under a unit clock) and ``id``.
Blank lines are skipped; anything else wrong raises ``ValueError`` naming the line. Pure Python.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_KEYS = frozenset({"prompt", "prompt_len", "max_tokens", "arrival_time_s", "id"})


@dataclass(frozen=True)
class WorkloadRequest:
    max_tokens: int
    prompt: str | None = None
    prompt_len: int | None = None
    arrival_time_s: float = 0.0
    request_id: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_len is None):
            raise ValueError("give exactly one of prompt and prompt_len")
        if self.prompt is not None and (not isinstance(self.prompt, str) or self.prompt == ""):
            raise ValueError(f"prompt must be a non-empty string, got {self.prompt!r}")
        if self.prompt_len is not None and not _is_int(self.prompt_len, lo=1):
            raise ValueError(f"prompt_len must be an integer >= 1, got {self.prompt_len!r}")
        if not _is_int(self.max_tokens, lo=1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = self.arrival_time_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"arrival_time_s must be a finite number >= 0, got {t!r}")
        if self.request_id is not None and (not isinstance(self.request_id, str) or self.request_id == ""):
            raise ValueError(f"id must be a non-empty string, got {self.request_id!r}")


@dataclass(frozen=True)
class Workload:
    requests: tuple[WorkloadRequest, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        ids = self.request_ids
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate request ids: {dupes}")

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id or f"r{i}" for i, r in enumerate(self.requests)]

    def __len__(self) -> int:
        return len(self.requests)


def seed_workload() -> Workload:
    """The seed's Day-29 shape: eight rows, a 5-token prompt each, seven wanting 4 tokens and one wanting 32."""
    requests = [WorkloadRequest(max_tokens=4, prompt_len=5) for _ in range(7)]
    requests.append(WorkloadRequest(max_tokens=32, prompt_len=5))
    return Workload(tuple(requests), name="seed (8 x 5-token prompts; 7 want 4 tokens, 1 wants 32)")


def load_workload(path: str | Path) -> Workload:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read workload file {str(path)!r}: {e}") from e
    return parse_workload_lines(text.splitlines(), source=str(path), name=path.name)


def parse_workload_lines(lines: Iterable[str], source: str = "<workload>", name: str = "custom") -> Workload:
    requests: list[WorkloadRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(_KEYS)})")
        if "max_tokens" not in obj:
            raise ValueError(f"{where}: max_tokens is required")
        try:
            requests.append(
                WorkloadRequest(
                    max_tokens=obj["max_tokens"],
                    prompt=obj.get("prompt"),
                    prompt_len=obj.get("prompt_len"),
                    arrival_time_s=obj.get("arrival_time_s", 0.0),
                    request_id=obj.get("id"),
                )
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    if not requests:
        raise ValueError(f"{source}: no requests in the workload")
    try:
        return Workload(tuple(requests), name=name)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e


@dataclass(frozen=True)
class ResolvedRequest:
    """A workload request with its prompt as token ids: what both the static and the continuous run get."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time_s: float


def resolve_workload(
    workload: Workload, encode: Callable[[str], list[int]], vocab_size: int
) -> list[ResolvedRequest]:
    """Token ids for every prompt: text through ``encode``, ``prompt_len`` through :func:`synthetic_prompt`."""
    resolved = []
    for i, (rid, req) in enumerate(zip(workload.request_ids, workload.requests)):
        if req.prompt is not None:
            ids = list(encode(req.prompt))
            if not ids:
                raise ValueError(f"request {rid!r}: prompt {req.prompt!r} encodes to no tokens")
        else:
            assert req.prompt_len is not None
            ids = synthetic_prompt(i, req.prompt_len, vocab_size)
        resolved.append(ResolvedRequest(rid, tuple(ids), req.max_tokens, float(req.arrival_time_s)))
    return resolved


def synthetic_prompt(index: int, length: int, vocab_size: int) -> list[int]:
    """``length`` deterministic token ids for request ``index``, distinct across requests, clear of the low ids
    where tokenizers keep their special tokens."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    lo = min(1000, vocab_size // 4)
    span = vocab_size - lo
    return [lo + (index * 7919 + j * 104729 + 12345) % span for j in range(length)]


def _is_int(value: object, lo: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= lo
