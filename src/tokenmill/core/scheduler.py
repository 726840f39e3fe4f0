"""Continuous batching: which tokens of which requests the next forward computes. Pure Python, no torch.

One step is one :class:`SchedulerOutput`, a flat batch that mixes decode rows and (chunks of) prompts
under ``max_num_seqs`` rows and ``max_num_batched_tokens`` tokens; there are no separate prefill and
decode phases. :meth:`Scheduler.schedule` works in two passes:

1. Running requests, in admission order. Each gets its remaining tokens (1 when decoding, more while a
   chunked prompt is still being prefilled), as far as the token budget goes, and blocks for them. When
   the pool is dry the most recently admitted running request is *preempted by recompute*: its blocks go
   back, ``num_computed_tokens`` drops to 0 and it returns to the head of the waiting queue with its output
   tokens kept (a request preempted more than ``max_num_preemptions`` times ends FINISHED_ABORTED).
2. Only if nobody was preempted: waiting requests, first come first served (the head blocks the rest),
   while rows, tokens and blocks allow. An admitted request prefills all of its not-computed tokens
   (prompt + outputs after a preemption); the one at the token-budget boundary gets a chunk
   (``sample=False``) and continues next step, unless ``enable_chunked_prefill`` is off (an encoder's
   prompts): then it waits for a step whose budget holds all of it.

:meth:`Scheduler.update_from_output` then appends the sampled tokens, finishes requests and frees their
blocks. Every row that could have run and did not is explained in ``StepRecord.idle_rows``.

Speculative decoding (a ``proposer``, ``core/proposers.py``): a decode row also carries the proposed tokens, given
slots only when they fit without preempting anyone; its update appends the tokens the runner verified up to the
first stop, counts the KV of the kept ones only as computed and gives back the blocks wholly past them. A draft
model may fill fewer slots than it was given (``ModelRunnerOutput.num_drafted``): the counts are of the tokens
it proposed, and a row it left empty is a plain decode row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import SchedulerConfig
from tokenmill.core.sched_output import (
    IdleReason,
    ModelRunnerOutput,
    ScheduledRow,
    SchedulerOutput,
    StepRecord,
)
from tokenmill.errors import OVERLOADED, STEP_FAILED, BadRequestError, ContextLengthError
from tokenmill.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenmill.core.proposers import Proposer


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        block_size: int,
        proposer: Proposer | None = None,
    ) -> None:
        """``proposer``: speculative decoding's (``core/proposers.py``: n-gram or draft-model slots); a decode
        row then carries its proposal."""
        if block_size != kv_manager.block_size:
            raise ValueError(f"block_size {block_size} != the KV-cache manager's {kv_manager.block_size}")
        if config.reserve != kv_manager.reserve:
            raise ValueError(
                f"scheduler reserve={config.reserve!r} but the KV-cache manager uses {kv_manager.reserve!r}"
            )
        self.config = config
        self.kv = kv_manager
        self.block_size = block_size
        self.proposer = proposer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the next preemption victim
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._finished_in_schedule: dict[str, Request] = {}  # ended by schedule(), not yet reported
        # request id -> most tokens it ever had computed: prefill below this mark is recomputation
        self._computed_high_water: dict[str, int] = {}
        self._now_s: float | None = None  # the clock reading handed to the current schedule()

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request by id (read-only)."""
        return MappingProxyType(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request, or one ended by the last ``schedule()`` and not yet reported."""
        request = self._requests.get(request_id)
        return request if request is not None else self._finished_in_schedule.get(request_id)

    # --- intake -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (FIFO). BadRequestError (param max_tokens) if it could never run: too long, or
        larger than the pool."""
        max_len = self.config.max_model_len
        if (
            request.max_num_tokens > max_len
        ):  # the one context-length check (the server's 400 comes from here)
            raise ContextLengthError(
                f"request {request.request_id!r}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling_params.max_tokens}) = {request.max_num_tokens} exceeds max_model_len ({max_len})",
                max_len,
                request.num_prompt_tokens,
                request.sampling_params.max_tokens,
            )
        worst_blocks = self.kv.max_blocks(request)
        if worst_blocks > self.kv.num_blocks:
            raise BadRequestError(
                f"request {request.request_id!r}: prompt + max_tokens = {request.max_num_tokens} tokens need "
                f"{worst_blocks} KV blocks of {self.block_size}, but the whole pool has {self.kv.num_blocks}; "
                f"lower max_tokens or give the KV cache more memory",
                param="max_tokens",
            )
        if not self.config.enable_chunked_prefill and request.num_tokens > self.config.max_num_batched_tokens:
            raise BadRequestError(
                f"request {request.request_id!r}: its {request.num_tokens} tokens exceed max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and prompts are not chunked",
                param="prompt",
            )
        if request.request_id in self._requests:
            raise BadRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"request {request.request_id!r} is not a fresh waiting request")
        self._requests[request.request_id] = request
        self.waiting.append(request)

    # --- one step -----------------------------------------------------------------------------
    def schedule(self, now_s: float | None = None) -> SchedulerOutput:
        """The next step's rows. ``now_s`` (the engine's clock) stamps a request's first admission."""
        self._now_s = now_s
        record = StepRecord(num_rows_possible=self.config.max_num_seqs)
        out = SchedulerOutput(rows=[], record=record)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        num_skipped = len(self.running) - len(out.rows)  # running, left out by the token budget
        reason = self._admit_waiting(out, budget)
        num_free_rows = self.config.max_num_seqs - len(self.running)
        record.batch_size = len(out.rows)
        idle: dict[IdleReason, int] = {}
        if num_skipped:
            idle[IdleReason.TOKEN_BUDGET] = num_skipped
        if num_free_rows:
            idle[reason] = idle.get(reason, 0) + num_free_rows
        record.idle_rows = idle
        for row in out.rows:
            if row.is_prefill:
                record.num_prefill_tokens += row.num_new_tokens
            else:
                record.num_decode_tokens += row.num_new_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Pass 1: a row for each running request while the token budget lasts. Returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens_to_compute, budget)
            assert num_new > 0, f"running request {request.request_id!r} has nothing to compute"
            self.kv.release_outside_window(request)  # a sliding window: blocks no query will read again
            spec = self._propose(request, budget)
            if spec and self.kv.allocate_slots(request, 1 + len(spec)) is None:
                spec = []  # proposed tokens never preempt anyone: without room, a plain decode row
            if not spec and not self._allocate_or_preempt(request, num_new, out):
                break  # it preempted itself: it was the last running request
            out.rows.append(self._make_row(request, num_new, out.record, spec))
            budget -= num_new + len(spec)
            i += 1
        return budget

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Speculative decoding: tokens to verify after a decoding request's last one, capped so that the
        step's budget, max_tokens and max_model_len hold even if every one is accepted (plus the bonus token)."""
        if self.proposer is None or request.num_output_tokens == 0 or request.num_tokens_to_compute != 1:
            return []
        room = min(
            budget - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(request, room, len(self.running)) if room > 0 else []

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for ``num_new`` tokens of a running request, preempting from the back of ``running``
        (the most recently admitted, never one already scheduled this step) until they fit.
        False when the request itself had to go."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> IdleReason:
        """Pass 2: admit from the head of the queue. Returns why the remaining rows stay empty."""
        if out.record.num_preemptions:
            return IdleReason.PREEMPTED if self.waiting else IdleReason.QUEUE_EMPTY
        while True:
            if not self.waiting:
                return IdleReason.QUEUE_EMPTY
            if len(self.running) >= self.config.max_num_seqs:
                return IdleReason.MAX_NUM_SEQS  # no free row: the reason is never counted
            if budget <= 0:
                return IdleReason.TOKEN_BUDGET
            index = self._next_admissible()
            if index is None:
                return IdleReason.LORA_SLOTS
            request = self.waiting[index]
            # The longest cached prefix counts as computed. A request that wants prompt logprobs skips the
            # cache: its logprobs need the logits of every prompt position.
            use_cache = self.kv.enable_caching and request.sampling_params.prompt_logprobs is None
            cached = self.kv.find_cached_prefix(request) if use_cache else []
            request.set_num_computed(len(cached) * self.block_size)
            num_new = min(request.num_tokens_to_compute, budget)
            if num_new < request.num_tokens_to_compute and not self.config.enable_chunked_prefill:
                request.set_num_computed(0)
                return IdleReason.TOKEN_BUDGET  # whole prompts only: it waits for a step with room
            lookahead = 1 if request.num_preemptions else 0  # anti-thrash: room to make progress
            if self.kv.allocate_slots(request, num_new, lookahead, cached_blocks=cached) is None:
                request.set_num_computed(0)
                if self.kv.reserve == "worst_case" and self.kv.would_fit_without_reservations(
                    request, num_new, lookahead
                ):
                    return IdleReason.KV_RESERVED
                return IdleReason.KV_POOL_FULL
            if use_cache:
                out.record.num_prefix_queried_tokens += request.num_tokens
                out.record.num_prefix_hit_tokens += request.num_computed_tokens
                request.record_cache_hit()
            del self.waiting[index]
            request.transition(RequestStatus.RUNNING)
            request.mark_scheduled(self._now_s)
            self.running.append(request)
            out.record.admitted_ids.append(request.request_id)
            out.rows.append(self._make_row(request, num_new, out.record))
            budget -= num_new

    def _next_admissible(self) -> int | None:
        """The waiting request to admit next: the head, unless its LoRA adapter would be one more than
        ``max_loras`` among the running requests; then the first after it that is not (None: none is)."""
        if not self.config.max_loras:
            return 0
        running = {r.lora_id for r in self.running if r.lora_id}
        for index, request in enumerate(self.waiting):
            if not request.lora_id or request.lora_id in running or len(running) < self.config.max_loras:
                return index
        return None

    def _make_row(
        self, request: Request, num_new: int, record: StepRecord, spec: list[int] | None = None
    ) -> ScheduledRow:
        start = request.num_computed_tokens
        end = start + num_new
        high_water = self._computed_high_water.get(request.request_id)
        if high_water is not None:
            num_recomputed = max(0, min(end, high_water) - start)
            record.num_recomputed_tokens += num_recomputed
            request.add_recomputed(num_recomputed)
            if end >= high_water:
                del self._computed_high_water[request.request_id]
        # A decode row computes just the last sampled token, whose KV was never computed.
        is_decode = request.num_output_tokens > 0 and start == request.num_tokens - 1
        spec = spec or []
        return ScheduledRow(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end]
            if not is_decode
            else [request.output_token_ids[-1], *spec],
            start_position=start,
            block_ids=list(request.block_ids),
            sample=end == request.num_tokens and request.sampling_params.max_tokens > 0,
            is_prefill=not is_decode,
            num_spec_tokens=len(spec),
            lora_id=request.lora_id,
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt by recompute: drop the blocks, back to the head of the queue (or abort past the bound)."""
        self.kv.free(request)
        rid = request.request_id
        self._computed_high_water[rid] = max(
            self._computed_high_water.get(rid, 0), request.num_computed_tokens
        )
        request.drop_computed()
        out.record.num_preemptions += 1
        out.record.preempted_ids.append(rid)
        if request.num_preemptions > self.config.max_num_preemptions:
            request.set_error(
                OVERLOADED,
                f"preempted {request.num_preemptions} times (max_num_preemptions="
                f"{self.config.max_num_preemptions}): the KV cache is too small for this load",
            )
            self._end(request, RequestStatus.FINISHED_ABORTED, None, None, remove_running=False)
            self._finished_in_schedule[rid] = request
            out.finished_ids.append(rid)
            return
        request.transition(RequestStatus.WAITING)
        self.waiting.appendleft(request)

    # --- results ------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, now_s: float
    ) -> list[Request]:
        """Apply one forward's results. Returns the requests that got a token or finished this step.

        Call it for every ``schedule()`` result, empty or not: requests that ``schedule()`` itself ended
        (``scheduler_output.finished_ids``) are returned here too.
        """
        touched = self._ended_in_schedule(scheduler_output, now_s)
        finished: set[str] = set()
        for row in scheduler_output.rows:
            request = self._requests.get(row.request_id)
            if request is None:  # aborted between schedule() and now: nothing of it is kept
                continue
            if request.num_computed_tokens != row.start_position:
                raise RuntimeError(f"request {request.request_id!r} changed under a scheduled row")
            if row.num_spec_tokens:
                if self._apply_verified(request, row, runner_output, scheduler_output.record, now_s):
                    finished.add(request.request_id)
                touched.append(request)
                continue
            request.advance(row.num_new_tokens)
            self.kv.cache_full_blocks(request)  # full blocks written this step become shareable
            if not row.sample:
                if (
                    request.sampling_params.max_tokens == 0
                    and request.num_computed_tokens == request.num_tokens
                ):
                    self._end(request, RequestStatus.FINISHED_LENGTH, None, now_s, remove_running=False)
                    finished.add(request.request_id)  # scored, nothing to sample (echo with max_tokens=0)
                    touched.append(request)
                continue
            sampled = runner_output.sampled.get(request.request_id)
            if sampled is None:
                raise RuntimeError(f"runner returned no token for request {request.request_id!r}")
            wants_logprobs = sampled.logprob is not None or sampled.top_logprobs is not None
            request.append_output_token(sampled.token_id, now_s, sampled if wants_logprobs else None)
            stop = self._check_stop(request)
            if stop is not None:
                status, stop_reason = stop
                self._end(request, status, stop_reason, now_s, remove_running=False)
                finished.add(request.request_id)
            touched.append(request)
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return touched

    def _apply_verified(
        self,
        request: Request,
        row: ScheduledRow,
        runner_output: ModelRunnerOutput,
        record: StepRecord,
        now_s: float,
    ) -> bool:
        """A row with a proposal: append the accepted tokens and the target's next one, stopping at the first
        stop; the computed count covers only the kept tokens' KV, the rejected tokens' blocks go back. True
        when the request finished."""
        num_proposed = runner_output.num_drafted.get(request.request_id, row.num_spec_tokens)
        if not 0 <= num_proposed <= row.num_spec_tokens:
            raise RuntimeError(f"runner drafted {num_proposed} tokens for request {request.request_id!r}")
        record.num_decode_tokens -= row.num_spec_tokens - num_proposed  # slots the drafter left unused
        if num_proposed == 0:  # the drafter proposed nothing: a plain decode row
            sampled = runner_output.sampled.get(request.request_id)
            if sampled is None:
                raise RuntimeError(f"runner returned no token for request {request.request_id!r}")
            tokens = [sampled]
            if self.proposer is not None:
                self.proposer.observe(request.request_id, 0, 0)
        else:
            tokens = runner_output.verified.get(request.request_id, [])
            if not tokens or len(tokens) > num_proposed + 1:
                raise RuntimeError(f"runner returned no verified tokens for request {request.request_id!r}")
            self._count_speculation(request, num_proposed, len(tokens) - 1, record)
        stop = None
        num_kept = 0
        for sampled in tokens:
            wants_logprobs = sampled.logprob is not None or sampled.top_logprobs is not None
            request.append_output_token(sampled.token_id, now_s, sampled if wants_logprobs else None)
            num_kept += 1
            stop = self._check_stop(request)
            if stop is not None:
                break  # tokens after a stop are dropped: never appended, their slots freed below
        request.advance(num_kept)  # the KV of the row's first token and of the kept proposed ones
        self.kv.trim_to(request, request.num_computed_tokens + 1)  # the next row's slot stays
        self.kv.cache_full_blocks(request)
        if stop is None:
            return False
        self._end(request, stop[0], stop[1], now_s, remove_running=False)
        return True

    def _count_speculation(
        self, request: Request, num_proposed: int, num_accepted: int, record: StepRecord
    ) -> None:
        request.record_speculation(num_proposed, num_accepted)
        record.num_spec_drafts += 1
        record.num_spec_draft_tokens += num_proposed
        record.num_spec_accepted_tokens += num_accepted
        per_pos = record.spec_accepted_per_pos
        per_pos.extend([0] * (num_proposed - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
        if self.proposer is not None:
            self.proposer.observe(request.request_id, num_proposed, num_accepted)

    def fail_step(self, scheduler_output: SchedulerOutput, error: str, now_s: float) -> list[Request]:
        """The step's forward failed: end each of its rows' requests with ``error`` (their blocks freed).

        Requests the step did not schedule are untouched; the ones ``schedule()`` itself ended are returned
        too, as from :meth:`update_from_output`, so that every request is still reported exactly once.
        """
        touched = self._ended_in_schedule(scheduler_output, now_s)
        for row in scheduler_output.rows:
            request = self._requests.get(row.request_id)
            if request is None:  # aborted between schedule() and now
                continue
            request.set_error(STEP_FAILED, error)
            self._end(request, RequestStatus.FINISHED_ABORTED, None, now_s)
            touched.append(request)
        return touched

    def _ended_in_schedule(self, scheduler_output: SchedulerOutput, now_s: float) -> list[Request]:
        """The requests ``schedule()`` ended (preemption bound), stamped with the time they are reported."""
        ended = []
        for rid in scheduler_output.finished_ids:
            request = self._finished_in_schedule.pop(rid, None)
            if request is not None:
                request.stamp_finished(now_s)
                ended.append(request)
        return ended

    def _check_stop(self, request: Request) -> tuple[RequestStatus, int | None] | None:
        """Token stops first (EOS, stop_token_ids; none before min_tokens), then length."""
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens > params.min_tokens:  # min_tokens tokens come before any stop token
            if token in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus,
        stop_reason: int | str | None = None,
        now_s: float | None = None,
        error: tuple[str, str] | None = None,
        num_output_tokens: int | None = None,
    ) -> Request | None:
        """End a request from outside (stop string, abort, a grammar's end or failure): waiting, running or
        preempted. ``error``: (kind, message) when the engine, not the caller, ends it. ``num_output_tokens``:
        keep only that many outputs (a stop string ended the text before the step's last token).

        Returns the request, or None when the id is unknown or already finished (abort races are normal).
        """
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if error is not None:
            request.set_error(*error)
        if num_output_tokens is not None:
            request.truncate_output(num_output_tokens)
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._end(request, status, stop_reason, now_s)
        return request

    def _end(
        self,
        request: Request,
        status: RequestStatus,
        stop_reason: int | str | None,
        now_s: float | None,
        remove_running: bool = True,
    ) -> None:
        was_running = request.status is RequestStatus.RUNNING
        request.finish(status, stop_reason, now_s)
        self.kv.free(request)
        del self._requests[request.request_id]
        self._computed_high_water.pop(request.request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        if was_running and remove_running:
            self.running.remove(request)

    # --- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise RuntimeError unless queues, statuses and block ownership agree (and the pool does)."""
        self.kv.check_integrity()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        if len(set(running_ids)) != len(running_ids) or len(set(waiting_ids)) != len(waiting_ids):
            raise RuntimeError("a request is queued twice")
        if set(running_ids) & set(waiting_ids):
            raise RuntimeError(f"running and waiting overlap: {set(running_ids) & set(waiting_ids)}")
        if set(running_ids) | set(waiting_ids) != set(self._requests):
            raise RuntimeError("running + waiting != unfinished requests")
        if len(self.running) > self.config.max_num_seqs:
            raise RuntimeError(f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        for r in self.running:
            if r.status is not RequestStatus.RUNNING:
                raise RuntimeError(f"request {r.request_id!r} in running is {r.status.name}")
            if r.num_tokens_to_compute < 1:
                raise RuntimeError(f"running request {r.request_id!r} has nothing to compute")
        for r in self.waiting:
            if r.status is not RequestStatus.WAITING:
                raise RuntimeError(f"request {r.request_id!r} in waiting is {r.status.name}")
            if (
                r.block_ids
                or r.num_reserved_blocks
                or r.num_computed_tokens
                or self.kv.owns_blocks(r.request_id)
            ):
                raise RuntimeError(f"waiting request {r.request_id!r} owns blocks or computed tokens")
        if self.kv.num_tracked_requests > len(self.running):
            raise RuntimeError("the KV-cache manager holds blocks for requests that are not running")
