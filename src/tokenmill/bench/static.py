"""Static batching on the real model (the seed's Day 29): what continuous batching is measured against.

A static batch of B requests runs the way a fixed batch does, with no scheduler:

1. one prefill phase: all B prompts in one forward, each row sampling its first token;
2. decode steps, every row computed at every step (done or not), until the longest row has all its tokens;
3. the batch is handed back as one object, each row keeping its first ``max_tokens`` tokens.

It drives a private :class:`ModelRunner` over the engine's loaded weights, with its own KV blocks (row ``i``
owns a fixed slice of them, sized for the longest row: a static batch books every row's worst case), through
the same ``SchedulerOutput -> ModelRunnerOutput`` contract the engine uses, so both loops share the model
code, the attention and the greedy sampler. The prefill is packed, not padded: prompts of different lengths
go into the one flat forward without pad tokens. Padding would add compute, never tokens, so it changes the
times and not the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.bench.timing import BatchTiming, Clock, WallClock, time_static_run
from tokenmill.bench.workload import ResolvedRequest
from tokenmill.core.sched_output import ScheduledRow, SchedulerOutput, StepRecord
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def greedy_params(max_tokens: int) -> SamplingParams:
    """What both loops sample with: greedy, and no early EOS, so both collect exactly max_tokens tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class StaticBatch:
    """B rows on a private model runner; :meth:`prefill` and :meth:`decode_step` each compute every row once."""

    def __init__(self, loaded: Any, requests: Sequence[ResolvedRequest], block_size: int = 16, seed: int = 0):
        from tokenmill.worker.model_runner import ModelRunner

        if not requests:
            raise ValueError("a static batch needs at least one request")
        self.num_steps_total = max(r.max_tokens for r in requests)  # every row generates this many
        longest = max(len(r.prompt_token_ids) for r in requests) + self.num_steps_total
        max_model_len = loaded.config.max_position_embeddings
        if longest > max_model_len:
            raise ValueError(
                f"prompt + max_tokens ({longest} tokens) exceeds the model's context ({max_model_len})"
            )
        blocks_per_row = -(-longest // block_size)
        self.rows: list[Request] = []
        by_id: dict[str, Request] = {}  # the runner reads their sampling state
        self.runner = ModelRunner(loaded, len(requests) * blocks_per_row, block_size, by_id, seed=seed)
        self.block_tables: list[list[int]] = []
        for i, r in enumerate(requests):
            request = Request(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=greedy_params(self.num_steps_total),
            )
            request.transition(RequestStatus.RUNNING)
            self.rows.append(request)
            by_id[request.request_id] = request
            self.block_tables.append(list(range(i * blocks_per_row, (i + 1) * blocks_per_row)))
        self.num_forwards = 0

    def prefill(self) -> dict[str, int]:
        return self._forward(
            [
                ScheduledRow(
                    req.request_id, list(req.prompt_token_ids), 0, table, sample=True, is_prefill=True
                )
                for req, table in zip(self.rows, self.block_tables)
            ]
        )

    def decode_step(self) -> dict[str, int]:
        return self._forward(
            [
                # The last sampled token is computed now, at position num_tokens - 1.
                ScheduledRow(
                    req.request_id,
                    [req.output_token_ids[-1]],
                    req.num_tokens - 1,
                    table,
                    sample=True,
                    is_prefill=False,
                )
                for req, table in zip(self.rows, self.block_tables)
            ]
        )

    def _forward(self, rows: list[ScheduledRow]) -> dict[str, int]:
        out = self.runner.execute(SchedulerOutput(rows=rows, record=StepRecord(batch_size=len(rows))))
        self.num_forwards += 1
        sampled = {rid: t.token_id for rid, t in out.sampled.items()}
        for req in self.rows:
            req.append_output_token(sampled[req.request_id], float(self.num_forwards))
        return sampled


def time_batched_decode(
    loaded: Any,
    requests: Sequence[ResolvedRequest],
    *,
    clock: Clock | None = None,
    block_size: int = 16,
    seed: int = 0,
) -> BatchTiming:
    """Run ``requests`` as one static batch on the real model and time it (prefill held out of the decode).

    ``loaded`` is a ``LoadedModel`` (``engine.loaded``). A static batch waits for its last request to arrive.
    """
    batch = StaticBatch(loaded, requests, block_size=block_size, seed=seed)
    return time_static_run(
        batch.prefill,
        batch.decode_step,
        max_tokens={r.request_id: r.max_tokens for r in requests},
        clock=clock or WallClock(),
        arrival_time_s={r.request_id: r.arrival_time_s for r in requests},
    )
