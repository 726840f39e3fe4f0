"""``tokenmill serve --record FILE``: every engine request, as ``tokenmill.measure.traffic`` lines (its format).

Written on the engine thread when a request ends, one line each, flushed at once (a killed server loses at
most the line being written). Never the prompt's text unless ``record_text``: its length and its blocks'
chained keys say what the scheduler and the prefix cache need. Never a request's own id either: a Responses
request's id is its stored response's, which opens the prompt and the answer to whoever holds the file and
can reach the server. A line's ``request_id`` keeps the API's prefix and the choice's index around an HMAC
of the id under a key drawn at start and never written (``chatcmpl-3f9c...-0``): lines of one request still
group, nothing in the file names a stored object.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import re
from pathlib import Path
from typing import Any

from tokenmill.measure.traffic import TrafficRequest, header_line, prefix_keys
from tokenmill.outputs import RequestDelta
from tokenmill.server.observers import AddedRequest


class IterationClock:
    """The engine's iterations as a clock: steps done, plus each idle gap in mean step times (a gap before the
    first step counts 0: no step time is known yet)."""

    def __init__(self, start_s: float) -> None:
        self.num_steps = 0
        self.busy_s = 0.0
        self.idle_units = 0.0
        self.idle_since: float | None = start_s

    @property
    def mean_step_s(self) -> float:
        return self.busy_s / self.num_steps if self.num_steps else 0.0

    def _gap_units(self, now_s: float) -> float:
        if self.idle_since is None or not self.num_steps:
            return 0.0
        return max(0.0, now_s - self.idle_since) / self.mean_step_s if self.mean_step_s else 0.0

    def step(self, start_s: float, end_s: float, has_work: bool) -> None:
        self.idle_units += self._gap_units(start_s)
        self.idle_since = None
        self.num_steps += 1
        self.busy_s += max(0.0, end_s - start_s)
        if not has_work:
            self.idle_since = end_s

    def now(self, now_s: float) -> float:
        return self.num_steps + self.idle_units + self._gap_units(now_s)


class TrafficRecorder:
    def __init__(self, path: str | Path, engine: Any, model: str | None, record_text: bool = False) -> None:
        self.tokenizer = engine.tokenizer
        self.block_size = int(engine.config.block_size)
        self.record_text = record_text
        self.start_s = engine.clock()
        self.clock = IterationClock(self.start_s)
        self._pending: dict[
            str, tuple[list[str], float, int]
        ] = {}  # id -> (prefix keys, arrival iteration, index)
        self._num_added = 0
        self._id_key = os.urandom(32)  # for recorded_id; kept in memory only
        config = {
            "block_size": self.block_size,
            "num_kv_blocks": int(engine.num_total_blocks),
            "max_num_seqs": engine.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": engine.scheduler_config.max_num_batched_tokens,
            "max_model_len": engine.scheduler_config.max_model_len,
            "reserve": engine.scheduler_config.reserve,
            "enable_prefix_caching": bool(engine.kv_manager.enable_caching),
        }
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (open until close())
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.file.write(header_line(config, model, started) + "\n")
        self.file.flush()

    def on_add(self, request: AddedRequest, now_s: float) -> None:
        keys = prefix_keys(request.prompt_token_ids, self.block_size, request.cache_salt)
        self._pending[request.request_id] = (keys, self.clock.now(now_s), self._num_added)
        self._num_added += 1

    def on_step(self, start_s: float, end_s: float, has_work: bool) -> None:
        self.clock.step(start_s, end_s, has_work)

    def on_finish(self, request: AddedRequest, delta: RequestDelta) -> None:
        keys, arrival_iteration, index = self._pending.pop(request.request_id, ([], self.clock.num_steps, -1))
        params, m = request.params, delta.metrics
        line = TrafficRequest(
            request_id=self.recorded_id(request.request_id),
            arrival_s=round(request.arrival_s - self.start_s, 6),
            arrival_iteration=round(arrival_iteration, 3),
            arrival_index=index,
            num_prompt_tokens=len(request.prompt_token_ids),
            prefix_keys=keys,
            max_tokens=params.max_tokens,
            num_output_tokens=m.num_output_tokens if m is not None else delta.num_output_tokens,
            finish_reason=delta.finish_reason,
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            top_p=params.top_p,
            num_cached_tokens=m.num_cached_tokens if m is not None else 0,
            num_preemptions=m.num_preemptions if m is not None else 0,
            time_to_first_token_s=m.time_to_first_token_s if m is not None else None,
            e2e_s=m.e2e_time_s if m is not None else None,
            prompt=self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)
            if self.record_text
            else None,
        )
        self.file.write(line.to_line() + "\n")
        self.file.flush()

    def recorded_id(self, request_id: str) -> str:
        """``request_id`` as the file shows it: the API's prefix, an HMAC of the rest, the choice's index."""
        base, dash, choice = request_id.rpartition("-")
        if not (dash and choice.isdigit()):
            base, choice = request_id, ""
        prefix = re.match(r"[A-Za-z]*", base)
        digest = hmac.new(self._id_key, base.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[
            :24
        ]
        return f"{prefix.group(0) if prefix else ''}-{digest}" + (f"-{choice}" if choice else "")

    def close(self) -> None:
        self.file.close()
