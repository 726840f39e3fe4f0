"""batchbench's timing types and its two timing cores (the seed's Day 29/32 harness). Pure Python, no torch.

Two ways to run one fixed set of requests, timed by one clock::

    static (Day 29)                              continuous (Day 32)
    time_static_run(prefill, decode_step)        time_continuous_run(iterate, has_work)
      one prefill phase, then decode steps         one timed call per engine iteration;
      until the longest row is done; every         a row is in the batch only while it
      row is computed at every step                still wants a token
            |                                              |
        BatchTiming                                 ContinuousTiming
            \\______________ compare_batching ______________/
              refuses the pairing unless both runs collected the same tokens
              for the same requests; answers in two kinds, apart in the type:
              BatchingCounts (hold on any machine) and BatchingTimes (this machine)

**Token-slots** are row-iterations: one row in one forward pass. A prefill row counts once however long its
prompt, so the seed workload (8 rows, 5-token prompts, seven wanting 4 tokens and one wanting 32) computes
8 x 32 = 256 token-slots statically and 60 under continuous batching, for the same 60 tokens.

**The two loops count tokens differently, by exactly one batch.** ``BatchTiming.useful_tokens`` counts decode
tokens only (its prefill is a separate phase that emitted one token per row, held out of the decode
denominator); ``ContinuousTiming.collected_tokens`` counts every token any request kept. So
``useful_tokens + batch_size == collected_tokens``, and :func:`compare_batching` checks it.

**Clocks.** Every core takes a :class:`Clock`. The cores read ``clock.now()`` at the boundaries of each timed
call and call ``clock.iteration_done()`` right after each call that computed a row; :class:`WallClock` ignores
that, :class:`UnitClock` advances by exactly 1 there. Under a unit clock every "time" in this module (fields
named ``*_s``, rates named ``*_tps``) counts iterations instead of seconds (``clock_unit`` says which), and the
makespan is the schedule's length: static 1 prefill + 31 decode steps = 32 on the seed workload, continuous 32
as well, a makespan speedup of 1.0. Continuous batching is not a makespan optimisation. (The seed measured
0.97 because its engine spent a 33rd iteration reaping the last request; tokenmill's engine frees a request in
the iteration that sampled its last token, so there is no reaping iteration to pay for.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


# --- clocks ---------------------------------------------------------------------------------------
class Clock(Protocol):
    """What a timing core reads. ``unit`` names what one unit of ``now()`` is ("s" or "iterations")."""

    @property
    def unit(self) -> str: ...

    def now(self) -> float: ...

    def iteration_done(self) -> None:
        """Called by a timing core right after each timed call that computed at least one row."""
        ...

    def wait_until(self, t: float) -> None:
        """Let time pass until ``now() >= t`` (arrivals in the future: nothing to compute meanwhile)."""
        ...


class WallClock:
    """``time.perf_counter``: seconds on this machine."""

    unit = "s"

    def now(self) -> float:
        return time.perf_counter()

    def iteration_done(self) -> None:
        pass

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class UnitClock:
    """Every iteration costs exactly 1, on any machine: times become iteration counts.

    ``now()`` is the number of iterations done so far (plus any waiting). Pass ``clock.now`` to an engine that
    wants a ``() -> float`` clock: reading it never advances it.
    """

    unit = "iterations"

    def __init__(self) -> None:
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def iteration_done(self) -> None:
        self._t += 1.0

    def wait_until(self, t: float) -> None:
        # Arrival times count iterations under this clock; round up to a whole iteration.
        self._t = max(self._t, float(math.ceil(t)))


def _ratio(num: float, den: float) -> float:
    """num / den; NaN when the denominator is zero (a fake clock that never moved, an empty run)."""
    return num / den if den else math.nan


class _RunTotals:
    """What a static and a continuous run compute the same way from their records: the tokens kept, the mean
    latency and the goodput over the whole run."""

    request_ids: tuple[str, ...]
    tokens: dict[str, tuple[int, ...]]
    # and, each its own way: makespan_s (a static run's is the sum of its phases) and latency_s

    @property
    def latency_s(self) -> dict[str, float]:
        raise NotImplementedError

    def _fields(self, names: str) -> dict[str, object]:
        """``to_dict``'s plain entries: each of the space-separated attributes by name (tuples as lists)."""
        values = {name: getattr(self, name) for name in names.split()}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    @property
    def collected_tokens(self) -> int:
        """Every token any request kept, its first (prefill) token included."""
        return sum(len(t) for t in self.tokens.values())

    @property
    def mean_latency_s(self) -> float:
        return _ratio(sum(self.latency_s.values()), len(self.request_ids))

    @property
    def end_to_end_goodput_tps(self) -> float:
        """Collected tokens over the whole run, prefill and waiting included: comparable between the loops."""
        return _ratio(self.collected_tokens, self.makespan_s)  # type: ignore[attr-defined]


# --- static batching -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchTiming(_RunTotals):
    """One static batch: a padded prefill phase, then decode steps until the longest row is done.

    Rows are in batch order (``request_ids``); row ``i`` wanted ``max_tokens[i]`` tokens: the one its prefill
    sampled plus ``max_tokens[i] - 1`` decode tokens. Every row is computed at every step, so a row that is done
    keeps costing a token-slot until the straggler is: that is the waste. Times are relative to the start of the
    run, in ``clock_unit``. The batch is returned as one object, so every row's answer arrives at the makespan.
    """

    request_ids: tuple[str, ...]
    max_tokens: tuple[int, ...]
    tokens: dict[str, tuple[int, ...]]  # per row: the first max_tokens tokens, the ones it kept
    arrival_time_s: dict[str, float]
    start_s: float  # when the batch started: a static batch waits for its last row to arrive
    prefill_time_s: float
    step_times_s: tuple[float, ...]
    clock_unit: str = "s"

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def num_decode_steps(self) -> int:
        return len(self.step_times_s)

    @property
    def num_iterations(self) -> int:
        """Forward passes: the prefill plus every decode step."""
        return 1 + self.num_decode_steps

    @property
    def useful_tokens(self) -> int:
        """Decode tokens that some row wanted (prefill tokens are not counted: a separate phase)."""
        return sum(m - 1 for m in self.max_tokens)

    @property
    def token_slots(self) -> int:
        """Rows times forward passes, prefill included (the seed's 256)."""
        return self.batch_size * self.num_iterations

    @property
    def decode_token_slots(self) -> int:
        return self.batch_size * self.num_decode_steps

    @property
    def waste_fraction(self) -> float:
        """Share of decode token-slots that computed a token no row wanted."""
        if self.decode_token_slots == 0:
            return 0.0
        return 1.0 - self.useful_tokens / self.decode_token_slots

    @property
    def decode_time_s(self) -> float:
        return sum(self.step_times_s)

    @property
    def decode_tps(self) -> float:
        """Useful decode tokens per unit of decode time: the prefill is held out of the denominator."""
        return _ratio(self.useful_tokens, self.decode_time_s)

    @property
    def makespan_s(self) -> float:
        return self.start_s + self.prefill_time_s + self.decode_time_s

    def row_done_s(self, request_id: str) -> float:
        """When the row had sampled its last wanted token (it is not handed back until the makespan)."""
        m = self.max_tokens[self.request_ids.index(request_id)]
        return self.start_s + self.prefill_time_s + sum(self.step_times_s[: m - 1])

    @property
    def latency_s(self) -> dict[str, float]:
        return {rid: self.makespan_s - self.arrival_time_s[rid] for rid in self.request_ids}

    @property
    def first_answer_s(self) -> float:
        """When the first answer is handed back: with the whole batch, at the makespan."""
        return self.makespan_s

    def to_dict(self) -> dict[str, object]:
        return {
            **self._fields(
                "clock_unit batch_size num_iterations num_decode_steps useful_tokens collected_tokens token_slots"
                " decode_token_slots waste_fraction start_s prefill_time_s decode_time_s step_times_s decode_tps"
                " makespan_s first_answer_s mean_latency_s end_to_end_goodput_tps"
            ),
            "requests": {
                rid: {
                    "max_tokens": m,
                    "arrival_time_s": self.arrival_time_s[rid],
                    "tokens": list(self.tokens[rid]),
                }
                for rid, m in zip(self.request_ids, self.max_tokens)
            },
        }


def time_static_run(
    prefill: Callable[[], Mapping[str, int]],
    decode_step: Callable[[], Mapping[str, int]],
    *,
    max_tokens: Mapping[str, int],
    clock: Clock,
    arrival_time_s: Mapping[str, float] | None = None,
) -> BatchTiming:
    """Time a static batch: ``prefill()`` once, then ``decode_step()`` until the longest row is done.

    ``max_tokens`` maps each row's request id to the tokens it wants, in batch order. Both callables compute
    every row and return one sampled token per row (request id -> token id). The batch starts when its last
    row has arrived (``arrival_time_s``, relative to the start of the run; default all at 0).
    """
    ids = tuple(max_tokens)
    if not ids:
        raise ValueError("a static batch needs at least one row")
    for rid, m in max_tokens.items():
        if m < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {m}")
    arrivals = _arrivals(ids, arrival_time_s)
    t_run = clock.now()
    clock.wait_until(t_run + max(arrivals.values()))
    t0 = clock.now()
    sampled: dict[str, list[int]] = {rid: [] for rid in ids}
    _collect_row_tokens(sampled, prefill(), "prefill")
    clock.iteration_done()
    t1 = clock.now()
    step_times: list[float] = []
    t_prev = t1
    for step in range(max(max_tokens.values()) - 1):
        _collect_row_tokens(sampled, decode_step(), f"decode step {step}")
        clock.iteration_done()
        t = clock.now()
        step_times.append(t - t_prev)
        t_prev = t
    return BatchTiming(
        request_ids=ids,
        max_tokens=tuple(max_tokens[rid] for rid in ids),
        tokens={rid: tuple(sampled[rid][: max_tokens[rid]]) for rid in ids},
        arrival_time_s=arrivals,
        start_s=t0 - t_run,
        prefill_time_s=t1 - t0,
        step_times_s=tuple(step_times),
        clock_unit=clock.unit,
    )


def _collect_row_tokens(sampled: dict[str, list[int]], got: Mapping[str, int], what: str) -> None:
    if set(got) != set(sampled):
        missing = sorted(set(sampled) - set(got))
        extra = sorted(set(got) - set(sampled))
        raise RuntimeError(
            f"{what} must compute every row of a static batch: missing {missing}, unexpected {extra}"
        )
    for rid, token in got.items():
        sampled[rid].append(token)


def _arrivals(ids: Sequence[str], arrival_time_s: Mapping[str, float] | None) -> dict[str, float]:
    arrivals = {rid: 0.0 for rid in ids}
    for rid, t in (arrival_time_s or {}).items():
        if rid not in arrivals:
            raise ValueError(f"arrival time for unknown request {rid!r}")
        if not t >= 0.0:
            raise ValueError(f"request {rid!r}: arrival time must be >= 0, got {t}")
        arrivals[rid] = float(t)
    return arrivals


# --- continuous batching ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class IterationOutcome:
    """What one engine iteration reports to :func:`time_continuous_run`.

    ``finished_ids`` are the requests that reached a terminal state during this iteration. A request's latency
    is stamped at the iteration that sampled its last token, even if the engine reports the finish later.
    """

    batch_size: int  # rows computed
    new_tokens: Mapping[str, Sequence[int]] = field(default_factory=dict)  # tokens each request kept now
    finished_ids: Sequence[str] = ()
    preempted_ids: Sequence[str] = ()
    # reason -> rows that could have run and did not
    idle_rows: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ContinuousTiming(_RunTotals):
    """One continuous-batching run: one record per iteration that computed a row.

    Times are relative to the start of the run, in ``clock_unit``; ``iteration_end_s[i]`` is when iteration
    ``i`` ended (waits for arrivals fall between iterations, so it is not a plain running sum).
    """

    request_ids: tuple[str, ...]
    max_num_seqs: int  # the batch width: rows one iteration could have computed
    arrival_time_s: dict[str, float]
    batch_sizes: tuple[int, ...]
    iteration_times_s: tuple[float, ...]
    iteration_end_s: tuple[float, ...]
    token_request_ids: tuple[tuple[str, ...], ...]  # per iteration: the requests that got a token
    preempted_ids: tuple[tuple[str, ...], ...]  # per iteration
    idle_rows: tuple[dict[str, int], ...]  # per iteration: reason -> idle rows
    finish_iteration: dict[str, int]  # index into batch_sizes of the iteration that sampled the last token
    finish_time_s: dict[str, float]
    tokens: dict[str, tuple[int, ...]]  # every token each request kept, in order
    makespan_s: float
    clock_unit: str = "s"

    @property
    def num_iterations(self) -> int:
        return len(self.batch_sizes)

    @property
    def token_slots(self) -> int:
        """Row-iterations computed (a prefill row counts once, like the static side's)."""
        return sum(self.batch_sizes)

    @property
    def waste_fraction(self) -> float:
        """Share of token-slots that kept no token (chunked-prefill rows, recomputation after preemption)."""
        if self.token_slots == 0:
            return 0.0
        return max(0.0, 1.0 - self.collected_tokens / self.token_slots)

    @property
    def occupancy(self) -> float:
        """How full the batch was: ``token_slots / (max_num_seqs * num_iterations)``."""
        return _ratio(self.token_slots, self.max_num_seqs * self.num_iterations)

    @property
    def num_preemptions(self) -> int:
        return sum(len(p) for p in self.preempted_ids)

    @property
    def idle_rows_by_reason(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for per_iteration in self.idle_rows:
            for reason, n in per_iteration.items():
                totals[reason] = totals.get(reason, 0) + n
        return totals

    @property
    def idle_fraction_by_reason(self) -> dict[str, float]:
        """Each reason's share of all row-iterations, so ``occupancy + sum(values) == 1`` when every idle row
        has a reason (the remainder, if any, is reported as ``"unattributed"``)."""
        total = self.max_num_seqs * self.num_iterations
        if total == 0:
            return {}
        shares = {reason: n / total for reason, n in self.idle_rows_by_reason.items() if n}
        num_idle = total - self.token_slots
        unattributed = num_idle - sum(self.idle_rows_by_reason.values())
        if unattributed > 0:
            shares["unattributed"] = unattributed / total
        return shares

    @property
    def idle_share_by_reason(self) -> dict[str, float]:
        """Each reason's share of the idle row-iterations only (sums to 1 when any row was idle)."""
        num_idle = self.max_num_seqs * self.num_iterations - self.token_slots
        if num_idle <= 0:
            return {}
        return {
            reason: share * self.max_num_seqs * self.num_iterations / num_idle
            for reason, share in self.idle_fraction_by_reason.items()
        }

    @property
    def latency_s(self) -> dict[str, float]:
        """Arrival to the iteration that sampled the request's last token."""
        return {rid: self.finish_time_s[rid] - self.arrival_time_s[rid] for rid in self.request_ids}

    @property
    def first_answer_s(self) -> float:
        """When the first request had its whole answer (from the start of the run)."""
        return min(self.finish_time_s.values()) if self.finish_time_s else math.nan

    def iteration_start_s(self, i: int) -> float:
        return self.iteration_end_s[i] - self.iteration_times_s[i]

    def to_dict(self) -> dict[str, object]:
        return {
            **self._fields(
                "clock_unit max_num_seqs num_iterations batch_sizes token_slots collected_tokens waste_fraction"
                " occupancy num_preemptions idle_rows_by_reason idle_fraction_by_reason idle_share_by_reason"
                " iteration_times_s makespan_s first_answer_s mean_latency_s end_to_end_goodput_tps"
            ),
            "requests": {
                rid: {
                    "arrival_time_s": self.arrival_time_s[rid],
                    "finish_iteration": self.finish_iteration[rid],
                    "finish_time_s": self.finish_time_s[rid],
                    "latency_s": self.latency_s[rid],
                    "tokens": list(self.tokens[rid]),
                }
                for rid in self.request_ids
            },
        }


def time_continuous_run(
    iterate: Callable[[], IterationOutcome],
    has_work: Callable[[], bool],
    *,
    request_ids: Sequence[str],
    max_num_seqs: int,
    clock: Clock,
    arrival_time_s: Mapping[str, float] | None = None,
    admit: Callable[[str], None] | None = None,
    max_calls: int = 1_000_000,
) -> ContinuousTiming:
    """Time one ``iterate()`` call per engine iteration until ``has_work()`` is false and nobody is to arrive.

    ``admit(request_id)`` submits a request once the clock reaches its arrival time (relative to the start of
    the run); without ``admit`` the requests must already be submitted and arrive at 0. A call that computed no
    row and reported nothing is not an iteration (see :func:`_is_iteration`); ``max_calls`` bounds a run that
    never makes progress.
    A broken report (a token for an unknown or finished request, a request finishing twice, a batch wider than
    ``max_num_seqs``, a request never finishing) raises ``RuntimeError``.
    """
    ids = tuple(request_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    arrivals = _arrivals(ids, arrival_time_s)
    if admit is None and any(t > 0 for t in arrivals.values()):
        raise ValueError("arrival times need an admit callable to submit each request when it arrives")
    pending = sorted(ids, key=lambda rid: arrivals[rid]) if admit is not None else []

    rec = _ContinuousRecorder(ids, max_num_seqs)
    t_run = clock.now()
    num_calls = 0
    while True:
        while pending and arrivals[pending[0]] <= clock.now() - t_run:
            assert admit is not None
            admit(pending.pop(0))
        if not has_work():
            if not pending:
                break
            clock.wait_until(t_run + arrivals[pending[0]])
            continue
        num_calls += 1
        if num_calls > max_calls:
            raise RuntimeError(f"no end after {max_calls} engine calls: unfinished {rec.unfinished()}")
        t0 = clock.now()
        outcome = iterate()
        if _is_iteration(outcome):
            clock.iteration_done()
        t1 = clock.now()
        rec.record(outcome, t0 - t_run, t1 - t_run)
    if rec.unfinished():
        raise RuntimeError(f"the run ended with requests that never reported finishing: {rec.unfinished()}")
    return rec.timing(arrivals, clock.now() - t_run, clock.unit)


def _is_iteration(outcome: IterationOutcome) -> bool:
    """A call that computed no row and reported nothing is not an iteration (it costs nothing on a unit clock).

    A call that computed no row but reported a finish (an engine that reaps a request one iteration after its
    last token) is one: that engine really spends the iteration.
    """
    reported = any(outcome.new_tokens.values()) or outcome.finished_ids or outcome.preempted_ids
    return outcome.batch_size > 0 or bool(reported)


class _ContinuousRecorder:
    """Checks each reported outcome against what came before and records it."""

    def timing(self, arrivals: dict[str, float], makespan_s: float, clock_unit: str) -> ContinuousTiming:
        """The run as recorded (call once every request has finished)."""
        return ContinuousTiming(
            request_ids=self.ids,
            max_num_seqs=self.max_num_seqs,
            arrival_time_s=arrivals,
            batch_sizes=tuple(self.batch_sizes),
            iteration_times_s=tuple(self.iteration_times),
            iteration_end_s=tuple(self.iteration_ends),
            token_request_ids=tuple(self.token_ids),
            preempted_ids=tuple(self.preempted),
            idle_rows=tuple(self.idle),
            finish_iteration=self.finish_iteration,
            finish_time_s={rid: self.iteration_ends[i] for rid, i in self.finish_iteration.items()},
            tokens={rid: tuple(self.tokens[rid]) for rid in self.ids},
            makespan_s=makespan_s,
            clock_unit=clock_unit,
        )

    def __init__(self, ids: tuple[str, ...], max_num_seqs: int) -> None:
        self.ids = ids
        self.max_num_seqs = max_num_seqs
        self.tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        self.last_token_iteration: dict[str, int] = {}
        self.finish_iteration: dict[str, int] = {}
        self.batch_sizes: list[int] = []
        self.iteration_times: list[float] = []
        self.iteration_ends: list[float] = []
        self.token_ids: list[tuple[str, ...]] = []
        self.preempted: list[tuple[str, ...]] = []
        self.idle: list[dict[str, int]] = []

    def unfinished(self) -> list[str]:
        return [rid for rid in self.ids if rid not in self.finish_iteration]

    def record(self, outcome: IterationOutcome, t0: float, t1: float) -> None:
        if not 0 <= outcome.batch_size <= self.max_num_seqs:
            raise RuntimeError(
                f"batch of {outcome.batch_size} rows does not fit max_num_seqs={self.max_num_seqs}"
            )
        if not _is_iteration(outcome):
            return
        got_tokens = {rid: list(t) for rid, t in outcome.new_tokens.items() if t}
        i = len(self.batch_sizes)
        for rid, new in got_tokens.items():
            self._check_known(rid, "got a token")
            if rid in self.finish_iteration:
                raise RuntimeError(f"request {rid!r} got a token after it finished")
            self.tokens[rid].extend(new)
            self.last_token_iteration[rid] = i
        for rid in outcome.preempted_ids:
            self._check_known(rid, "was preempted")
        for rid in outcome.finished_ids:
            self._check_known(rid, "finished")
            if rid in self.finish_iteration:
                raise RuntimeError(
                    f"request {rid!r} reported finishing twice (iterations {self.finish_iteration[rid]} and {i}):"
                    " a second stamp would overwrite the first with a later one"
                )
            # Stamped at the last token, not at the reap: the answer exists once its last token is sampled.
            self.finish_iteration[rid] = self.last_token_iteration.get(rid, i)
        self.batch_sizes.append(outcome.batch_size)
        self.iteration_times.append(t1 - t0)
        self.iteration_ends.append(t1)
        self.token_ids.append(tuple(got_tokens))
        self.preempted.append(tuple(outcome.preempted_ids))
        self.idle.append({reason: n for reason, n in outcome.idle_rows.items() if n})

    def _check_known(self, rid: str, what: str) -> None:
        if rid not in self.tokens:
            raise RuntimeError(f"unknown request {rid!r} {what}")


# --- the comparison ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchingCounts:
    """Properties of the two schedules: rows and tokens, the same on any machine."""

    collected_tokens: int
    static_token_slots: int
    continuous_token_slots: int
    static_useful_tokens: int  # decode tokens some row wanted
    static_decode_token_slots: int
    static_waste_fraction: float
    continuous_waste_fraction: float
    static_iterations: int
    continuous_iterations: int
    static_width: int  # the static batch size
    continuous_width: int  # max_num_seqs
    occupancy: float  # continuous token-slots over (continuous_width * continuous_iterations)
    num_preemptions: int
    idle_fraction_by_reason: dict[str, float]  # share of continuous row-iterations idle, by reason

    @property
    def work_ratio(self) -> float:
        """Static forward work over continuous forward work, for identical text (the seed's 4.27)."""
        return _ratio(self.static_token_slots, self.continuous_token_slots)

    @property
    def waste_removed(self) -> float:
        """Share of the static waste that continuous batching removed: 1.0 means gone, not reduced."""
        if self.static_waste_fraction == 0.0:
            return 0.0
        return (self.static_waste_fraction - self.continuous_waste_fraction) / self.static_waste_fraction

    def to_dict(self) -> dict[str, object]:
        return {
            "collected_tokens": self.collected_tokens,
            "static_token_slots": self.static_token_slots,
            "continuous_token_slots": self.continuous_token_slots,
            "static_useful_tokens": self.static_useful_tokens,
            "static_decode_token_slots": self.static_decode_token_slots,
            "static_waste_fraction": self.static_waste_fraction,
            "continuous_waste_fraction": self.continuous_waste_fraction,
            "work_ratio": self.work_ratio,
            "waste_removed": self.waste_removed,
            "static_iterations": self.static_iterations,
            "continuous_iterations": self.continuous_iterations,
            "static_width": self.static_width,
            "continuous_width": self.continuous_width,
            "occupancy": self.occupancy,
            "num_preemptions": self.num_preemptions,
            "idle_fraction_by_reason": dict(self.idle_fraction_by_reason),
        }


@dataclass(frozen=True)
class BatchingTimes:
    """Properties of this machine (or, under a unit clock, iteration counts): ``unit`` says which.

    Speedups are static over continuous for durations and continuous over static for goodput, so > 1 always
    means continuous batching did better.
    """

    unit: str
    static_makespan_s: float
    continuous_makespan_s: float
    static_first_answer_s: float
    continuous_first_answer_s: float
    static_mean_latency_s: float
    continuous_mean_latency_s: float
    static_goodput_tps: float
    continuous_goodput_tps: float

    @property
    def makespan_speedup(self) -> float:
        return _ratio(self.static_makespan_s, self.continuous_makespan_s)

    @property
    def mean_latency_speedup(self) -> float:
        return _ratio(self.static_mean_latency_s, self.continuous_mean_latency_s)

    @property
    def first_answer_speedup(self) -> float:
        return _ratio(self.static_first_answer_s, self.continuous_first_answer_s)

    @property
    def goodput_speedup(self) -> float:
        return _ratio(self.continuous_goodput_tps, self.static_goodput_tps)

    def to_dict(self) -> dict[str, object]:
        return {
            "unit": self.unit,
            "static_makespan_s": self.static_makespan_s,
            "continuous_makespan_s": self.continuous_makespan_s,
            "static_first_answer_s": self.static_first_answer_s,
            "continuous_first_answer_s": self.continuous_first_answer_s,
            "static_mean_latency_s": self.static_mean_latency_s,
            "continuous_mean_latency_s": self.continuous_mean_latency_s,
            "static_goodput_tps": self.static_goodput_tps,
            "continuous_goodput_tps": self.continuous_goodput_tps,
            "makespan_speedup": self.makespan_speedup,
            "mean_latency_speedup": self.mean_latency_speedup,
            "first_answer_speedup": self.first_answer_speedup,
            "goodput_speedup": self.goodput_speedup,
        }


@dataclass(frozen=True)
class BatchingComparison:
    """Counts that travel and times that do not, kept apart in the type."""

    counts: BatchingCounts
    times: BatchingTimes

    def to_dict(self) -> dict[str, object]:
        return {"counts": self.counts.to_dict(), "times": self.times.to_dict()}


def compare_batching(static: BatchTiming, continuous: ContinuousTiming) -> BatchingComparison:
    """Put the two runs side by side; ``ValueError`` unless they collected the same tokens for the same requests.

    The refusal is the function: a ratio between two runs that produced different text answers no question.
    """
    if static.clock_unit != continuous.clock_unit:
        raise ValueError(
            f"runs timed on different clocks: {static.clock_unit!r} vs {continuous.clock_unit!r}"
        )
    s_ids, c_ids = set(static.request_ids), set(continuous.request_ids)
    if s_ids != c_ids:
        raise ValueError(
            f"the runs served different requests: only static {sorted(s_ids - c_ids)},"
            f" only continuous {sorted(c_ids - s_ids)}"
        )
    for rid in static.request_ids:
        _check_same_tokens(rid, static.tokens[rid], continuous.tokens[rid])
    if static.useful_tokens + static.batch_size != continuous.collected_tokens:
        raise ValueError(
            f"token accounting does not pair: static useful_tokens ({static.useful_tokens}) + batch_size"
            f" ({static.batch_size}) != continuous collected_tokens ({continuous.collected_tokens})"
        )
    counts = BatchingCounts(
        collected_tokens=continuous.collected_tokens,
        static_token_slots=static.token_slots,
        continuous_token_slots=continuous.token_slots,
        static_useful_tokens=static.useful_tokens,
        static_decode_token_slots=static.decode_token_slots,
        static_waste_fraction=static.waste_fraction,
        continuous_waste_fraction=continuous.waste_fraction,
        static_iterations=static.num_iterations,
        continuous_iterations=continuous.num_iterations,
        static_width=static.batch_size,
        continuous_width=continuous.max_num_seqs,
        occupancy=continuous.occupancy,
        num_preemptions=continuous.num_preemptions,
        idle_fraction_by_reason=continuous.idle_fraction_by_reason,
    )
    times = BatchingTimes(
        unit=static.clock_unit,
        static_makespan_s=static.makespan_s,
        continuous_makespan_s=continuous.makespan_s,
        static_first_answer_s=static.first_answer_s,
        continuous_first_answer_s=continuous.first_answer_s,
        static_mean_latency_s=static.mean_latency_s,
        continuous_mean_latency_s=continuous.mean_latency_s,
        static_goodput_tps=static.end_to_end_goodput_tps,
        continuous_goodput_tps=continuous.end_to_end_goodput_tps,
    )
    return BatchingComparison(counts=counts, times=times)


def _check_same_tokens(rid: str, static: Sequence[int], continuous: Sequence[int]) -> None:
    if list(static) == list(continuous):
        return
    for pos, (a, b) in enumerate(zip(static, continuous)):
        if a != b:
            raise ValueError(
                f"request {rid!r}: the runs collected different tokens: output position {pos} is {a} statically"
                f" and {b} under continuous batching"
            )
    raise ValueError(
        f"request {rid!r}: the runs collected different tokens: {len(static)} statically,"
        f" {len(continuous)} under continuous batching"
    )
