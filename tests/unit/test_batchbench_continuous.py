"""batchbench, continuous side (Day 32) and compare_batching: a fake clock, a scripted engine, hand-computed numbers."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import pytest

from tokenmill.bench.timing import (
    BatchTiming,
    ContinuousTiming,
    IterationOutcome,
    UnitClock,
    compare_batching,
    time_continuous_run,
    time_static_run,
)

SEED_MAX_TOKENS = {f"r{i}": 4 for i in range(7)} | {"r7": 32}


class FakeClock:
    unit = "s"

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def iteration_done(self) -> None:
        pass

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


def token(rid: str, k: int) -> int:
    """The k-th token request ``rid`` samples, in both scripted loops."""
    return 1000 * int(rid[1:]) + k


class ScriptedEngine:
    """A continuous-batching loop in miniature: FIFO admission up to ``width`` rows, one token per running row per
    iteration, a request finishes (and frees its row) in the iteration that samples its last token.

    ``cost(batch_size)`` is what an iteration adds to a :class:`FakeClock`. ``reap_late`` imitates the seed's
    engine, which reported a finish one iteration after the last token.
    """

    def __init__(
        self,
        max_tokens: Mapping[str, int],
        width: int,
        clock: FakeClock | None = None,
        cost=lambda n: 1.0,
        reap_late: bool = False,
    ):
        self.max_tokens = dict(max_tokens)
        self.width = width
        self.clock = clock
        self.cost = cost
        self.reap_late = reap_late
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.to_reap: list[str] = []
        self.num_sampled: dict[str, int] = {}

    def admit(self, rid: str) -> None:
        self.waiting.append(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.to_reap)

    def step(self) -> IterationOutcome:
        reaped, self.to_reap = self.to_reap, []
        while self.waiting and len(self.running) < self.width:
            self.running.append(self.waiting.pop(0))
        batch = list(self.running)
        if self.clock is not None and batch:
            self.clock.advance(self.cost(len(batch)))
        new_tokens = {}
        done = []
        for rid in batch:
            k = self.num_sampled.get(rid, 0)
            new_tokens[rid] = [token(rid, k)]
            self.num_sampled[rid] = k + 1
            if k + 1 == self.max_tokens[rid]:
                done.append(rid)
                self.running.remove(rid)
        if self.reap_late:
            self.to_reap = done
            finished = reaped
        else:
            finished = done
        idle = self.width - len(batch)
        return IterationOutcome(
            batch_size=len(batch),
            new_tokens=new_tokens,
            finished_ids=finished,
            idle_rows={"queue_empty": idle} if idle and not self.waiting else {},
        )


def run_continuous(
    clock: FakeClock | UnitClock,
    max_tokens: Mapping[str, int] = SEED_MAX_TOKENS,
    width: int = 8,
    cost=lambda n: 1.0 + 0.25 * n,
    reap_late: bool = False,
    arrival_time_s: Mapping[str, float] | None = None,
) -> ContinuousTiming:
    engine = ScriptedEngine(
        max_tokens, width, clock if isinstance(clock, FakeClock) else None, cost, reap_late
    )
    return time_continuous_run(
        engine.step,
        engine.has_work,
        request_ids=list(max_tokens),
        max_num_seqs=width,
        clock=clock,
        arrival_time_s=arrival_time_s,
        admit=engine.admit,
    )


def run_static(clock: FakeClock | UnitClock, cost=lambda n: 1.0 + 0.25 * n) -> BatchTiming:
    ids = list(SEED_MAX_TOKENS)
    k = 0

    def forward() -> dict[str, int]:
        nonlocal k
        if isinstance(clock, FakeClock):
            clock.advance(cost(len(ids)))
        out = {rid: token(rid, k) for rid in ids}
        k += 1
        return out

    return time_static_run(forward, forward, max_tokens=SEED_MAX_TOKENS, clock=clock)


# --- counts ----------------------------------------------------------------------------------------
def test_seed_workload_schedule() -> None:
    timing = run_continuous(FakeClock())
    assert timing.batch_sizes == (8, 8, 8, 8) + (1,) * 28
    assert timing.num_iterations == 32
    assert timing.token_slots == 60
    assert timing.collected_tokens == 60
    assert timing.waste_fraction == 0.0
    assert timing.occupancy == pytest.approx(60 / 256)
    assert f"{timing.occupancy:.3f}" == "0.234"
    assert timing.finish_iteration == {f"r{i}": 3 for i in range(7)} | {"r7": 31}


def test_collects_every_token_each_request_kept() -> None:
    timing = run_continuous(FakeClock())
    assert timing.tokens["r0"] == (0, 1, 2, 3)
    assert timing.tokens["r7"] == tuple(7000 + k for k in range(32))
    assert timing.token_request_ids[0] == tuple(f"r{i}" for i in range(8))
    assert timing.token_request_ids[4] == ("r7",)


def test_idle_rows_explain_the_occupancy() -> None:
    timing = run_continuous(FakeClock())
    assert timing.idle_rows_by_reason == {"queue_empty": 7 * 28}
    assert timing.idle_fraction_by_reason == {"queue_empty": pytest.approx(196 / 256)}
    assert timing.occupancy + sum(timing.idle_fraction_by_reason.values()) == pytest.approx(1.0)
    assert timing.idle_share_by_reason == {"queue_empty": pytest.approx(1.0)}  # of the idle rows only


def test_idle_rows_without_a_reason_are_reported_unattributed() -> None:
    left = [
        IterationOutcome(
            batch_size=1, new_tokens={"a": [5]}, finished_ids=["a"], idle_rows={"kv_pool_full": 1}
        )
    ]
    timing = time_continuous_run(
        lambda: left.pop(0), lambda: bool(left), request_ids=["a"], max_num_seqs=4, clock=UnitClock()
    )
    # 4 row-iterations: 1 computed, 1 idle for the pool, 2 idle with no reason given.
    assert timing.occupancy == 0.25
    assert timing.idle_fraction_by_reason == {"kv_pool_full": 0.25, "unattributed": 0.5}
    assert timing.idle_share_by_reason == {
        "kv_pool_full": pytest.approx(1 / 3),
        "unattributed": pytest.approx(2 / 3),
    }


# --- times -----------------------------------------------------------------------------------------
def test_times_on_a_fake_clock() -> None:
    # An iteration costs 1 + 0.25 per row: four iterations of 8 rows (3.0 each), then 28 of one row (1.25 each).
    timing = run_continuous(FakeClock())
    assert timing.iteration_times_s == (3.0,) * 4 + (1.25,) * 28
    assert timing.makespan_s == pytest.approx(47.0)
    assert timing.first_answer_s == pytest.approx(12.0)
    assert timing.finish_time_s["r7"] == pytest.approx(47.0)
    assert timing.mean_latency_s == pytest.approx((7 * 12.0 + 47.0) / 8)
    assert timing.end_to_end_goodput_tps == pytest.approx(60 / 47.0)


def test_unit_clock_reports_the_schedule_in_iterations() -> None:
    timing = run_continuous(UnitClock())
    assert timing.clock_unit == "iterations"
    assert timing.makespan_s == 32.0
    assert timing.first_answer_s == 4.0
    assert timing.mean_latency_s == pytest.approx((7 * 4 + 32) / 8)


def test_latency_is_stamped_at_the_last_token_not_at_the_reap() -> None:
    # The seed's engine reported each finish one iteration late and spent a 33rd iteration reaping the last one.
    timing = run_continuous(UnitClock(), reap_late=True)
    assert timing.batch_sizes == (8, 8, 8, 8) + (1,) * 28 + (0,)
    assert timing.makespan_s == 33.0
    assert timing.finish_iteration["r0"] == 3  # reported in iteration 4, stamped at 3
    assert timing.finish_iteration["r7"] == 31  # reported in iteration 32, stamped at 31
    assert timing.first_answer_s == 4.0
    assert timing.finish_time_s["r7"] == 32.0


def test_the_seeds_reaping_iteration_is_where_its_097_came_from() -> None:
    static = run_static(UnitClock())
    seed_engine = compare_batching(static, run_continuous(UnitClock(), reap_late=True))
    assert seed_engine.times.makespan_speedup == pytest.approx(32 / 33)
    assert f"{seed_engine.times.makespan_speedup:.2f}" == "0.97"
    ours = compare_batching(static, run_continuous(UnitClock()))
    assert ours.times.makespan_speedup == 1.0  # continuous batching is not a makespan optimisation


def test_arrivals_are_admitted_on_time_and_idle_gaps_are_not_iterations() -> None:
    clock = FakeClock()
    timing = run_continuous(
        clock, max_tokens={"r0": 2, "r1": 2}, width=2, cost=lambda n: 1.0, arrival_time_s={"r1": 10.0}
    )
    assert timing.batch_sizes == (1, 1, 1, 1)
    assert timing.iteration_end_s == (1.0, 2.0, 11.0, 12.0)
    assert timing.iteration_start_s(2) == 10.0
    assert timing.makespan_s == 12.0
    assert timing.latency_s == {"r0": 2.0, "r1": 2.0}
    assert timing.first_answer_s == 2.0
    assert timing.end_to_end_goodput_tps == pytest.approx(4 / 12)


def test_arrivals_on_a_unit_clock_count_iterations() -> None:
    timing = run_continuous(UnitClock(), max_tokens={"r0": 2, "r1": 2}, width=2, arrival_time_s={"r1": 1.0})
    assert timing.batch_sizes == (1, 2, 1)
    assert timing.makespan_s == 3.0
    assert timing.latency_s == {"r0": 2.0, "r1": 2.0}


def test_to_dict_is_json_ready() -> None:
    d = run_continuous(UnitClock()).to_dict()
    json.dumps(d)
    assert d["token_slots"] == 60
    assert d["batch_sizes"][:5] == [8, 8, 8, 8, 1]


# --- broken reports --------------------------------------------------------------------------------
def scripted(*outcomes: IterationOutcome, ids=("a", "b"), width: int = 2) -> ContinuousTiming:
    left = list(outcomes)
    return time_continuous_run(
        lambda: left.pop(0), lambda: bool(left), request_ids=list(ids), max_num_seqs=width, clock=UnitClock()
    )


def test_a_request_that_reports_finishing_twice_is_rejected() -> None:
    with pytest.raises(RuntimeError, match="'a' reported finishing twice"):
        scripted(
            IterationOutcome(2, {"a": [1], "b": [2]}, finished_ids=["a"]),
            IterationOutcome(1, {"b": [3]}, finished_ids=["a", "b"]),
        )


def test_a_token_after_finishing_is_rejected() -> None:
    with pytest.raises(RuntimeError, match="'a' got a token after it finished"):
        scripted(
            IterationOutcome(2, {"a": [1], "b": [2]}, finished_ids=["a"]),
            IterationOutcome(2, {"a": [9], "b": [3]}, finished_ids=["b"]),
        )


def test_unknown_requests_and_overfull_batches_are_rejected() -> None:
    with pytest.raises(RuntimeError, match="unknown request 'z'"):
        scripted(IterationOutcome(1, {"z": [1]}))
    with pytest.raises(RuntimeError, match="unknown request 'z' finished"):
        scripted(IterationOutcome(1, {"a": [1]}, finished_ids=["z"]))
    with pytest.raises(RuntimeError, match="does not fit max_num_seqs=2"):
        scripted(IterationOutcome(3, {"a": [1]}))


def test_a_request_that_never_finishes_is_rejected() -> None:
    with pytest.raises(RuntimeError, match=r"never reported finishing: \['b'\]"):
        scripted(IterationOutcome(2, {"a": [1], "b": [2]}, finished_ids=["a"]))


def test_an_engine_that_makes_no_progress_is_stopped() -> None:
    with pytest.raises(RuntimeError, match="no end after 5 engine calls"):
        time_continuous_run(
            lambda: IterationOutcome(0),
            lambda: True,
            request_ids=["a"],
            max_num_seqs=1,
            clock=UnitClock(),
            max_calls=5,
        )


def test_empty_calls_are_not_iterations() -> None:
    timing = scripted(
        IterationOutcome(0),
        IterationOutcome(2, {"a": [1], "b": [2]}, finished_ids=["a", "b"]),
    )
    assert timing.batch_sizes == (2,)
    assert timing.makespan_s == 1.0


def test_arrivals_need_an_admit_callable() -> None:
    with pytest.raises(ValueError, match="admit"):
        time_continuous_run(
            lambda: IterationOutcome(0),
            lambda: False,
            request_ids=["a"],
            max_num_seqs=1,
            clock=UnitClock(),
            arrival_time_s={"a": 2.0},
        )


# --- compare_batching --------------------------------------------------------------------------------
def test_compare_on_the_seed_workload_counts() -> None:
    cmp = compare_batching(run_static(FakeClock()), run_continuous(FakeClock()))
    c = cmp.counts
    assert c.static_token_slots == 256
    assert c.continuous_token_slots == 60
    assert c.collected_tokens == 60
    assert c.static_useful_tokens == 52
    assert c.static_decode_token_slots == 248
    assert c.static_waste_fraction == pytest.approx(196 / 248)
    assert c.continuous_waste_fraction == 0.0
    assert c.work_ratio == pytest.approx(256 / 60)
    assert f"{c.work_ratio:.2f}" == "4.27"
    assert c.waste_removed == 1.0  # gone, not reduced
    assert c.occupancy == pytest.approx(60 / 256)
    assert (c.static_iterations, c.continuous_iterations) == (32, 32)
    assert (c.static_width, c.continuous_width) == (8, 8)
    assert c.num_preemptions == 0
    assert c.idle_fraction_by_reason == {"queue_empty": pytest.approx(196 / 256)}


def test_compare_on_the_seed_workload_times() -> None:
    # Both loops pay 1 + 0.25 per row per forward: static 32 x 3.0 = 96; continuous 4 x 3.0 + 28 x 1.25 = 47.
    t = compare_batching(run_static(FakeClock()), run_continuous(FakeClock())).times
    assert t.unit == "s"
    assert t.static_makespan_s == pytest.approx(96.0)
    assert t.continuous_makespan_s == pytest.approx(47.0)
    assert t.makespan_speedup == pytest.approx(96 / 47)
    assert t.first_answer_speedup == pytest.approx(96 / 12)
    assert t.mean_latency_speedup == pytest.approx(96 / ((7 * 12 + 47) / 8))
    assert t.goodput_speedup == pytest.approx((60 / 47) / (60 / 96))


def test_compare_under_a_unit_clock() -> None:
    t = compare_batching(run_static(UnitClock()), run_continuous(UnitClock())).times
    assert t.unit == "iterations"
    assert (t.static_makespan_s, t.continuous_makespan_s) == (32.0, 32.0)
    assert t.makespan_speedup == 1.0
    assert t.goodput_speedup == 1.0
    assert t.first_answer_speedup == 8.0  # 32 / 4
    assert t.mean_latency_speedup == pytest.approx(32 / 7.5)


def test_counts_and_times_are_kept_apart() -> None:
    d = compare_batching(run_static(UnitClock()), run_continuous(UnitClock())).to_dict()
    json.dumps(d)
    assert set(d) == {"counts", "times"}
    assert "work_ratio" in d["counts"] and "makespan_speedup" not in d["counts"]
    assert "makespan_speedup" in d["times"] and "work_ratio" not in d["times"]


def _with_tokens(timing: ContinuousTiming, rid: str, tokens: tuple[int, ...]) -> ContinuousTiming:
    from dataclasses import replace

    return replace(timing, tokens=timing.tokens | {rid: tokens})


def test_a_pairing_with_one_token_different_is_refused_naming_the_request() -> None:
    static, continuous = run_static(UnitClock()), run_continuous(UnitClock())
    changed = (3000, 3001, 999, 3003)
    with pytest.raises(ValueError, match=r"request 'r3'.*output position 2 is 3002 statically and 999"):
        compare_batching(static, _with_tokens(continuous, "r3", changed))


def test_a_pairing_with_a_missing_token_is_refused() -> None:
    static, continuous = run_static(UnitClock()), run_continuous(UnitClock())
    with pytest.raises(ValueError, match=r"request 'r7'.*32 statically, 31 under continuous"):
        compare_batching(static, _with_tokens(continuous, "r7", continuous.tokens["r7"][:-1]))


def test_a_pairing_of_different_requests_is_refused() -> None:
    static = run_static(UnitClock())
    other = run_continuous(UnitClock(), max_tokens={"r0": 4, "r9": 4})
    with pytest.raises(ValueError, match=r"only static \['r1', .*only continuous \['r9'\]"):
        compare_batching(static, other)


def test_a_pairing_across_clocks_is_refused() -> None:
    with pytest.raises(ValueError, match="different clocks"):
        compare_batching(run_static(UnitClock()), run_continuous(FakeClock()))


def test_the_token_accounting_is_checked_not_assumed() -> None:
    # A static timing whose rows kept fewer tokens than they wanted cannot pair, even with matching text.
    static = BatchTiming(
        request_ids=("a",),
        max_tokens=(3,),
        tokens={"a": (1, 2)},
        arrival_time_s={"a": 0.0},
        start_s=0.0,
        prefill_time_s=1.0,
        step_times_s=(1.0, 1.0),
        clock_unit="iterations",
    )
    continuous = scripted(IterationOutcome(1, {"a": [1, 2]}, finished_ids=["a"]), ids=("a",), width=1)
    with pytest.raises(
        ValueError, match=r"useful_tokens \(2\) \+ batch_size \(1\) != continuous collected_tokens \(2\)"
    ):
        compare_batching(static, continuous)


def test_ratios_over_a_clock_that_never_moved_are_nan() -> None:
    t = compare_batching(
        run_static(FakeClock(), cost=lambda n: 0.0), run_continuous(FakeClock(), cost=lambda n: 0.0)
    )
    assert math.isnan(t.times.makespan_speedup)
    assert t.counts.work_ratio == pytest.approx(256 / 60)


# --- the picture, from synthetic timings -------------------------------------------------------------
def test_plot_draws_both_runs_with_preemptions_and_idle_reasons(tmp_path) -> None:
    import matplotlib.image

    from tokenmill.bench.plot import plot_batching

    outcomes = [
        IterationOutcome(2, {"r0": [0], "r1": [1000]}, idle_rows={"kv_reserved": 1}),
        IterationOutcome(1, {"r0": [1]}, preempted_ids=["r1"], idle_rows={"preempted": 2}),
        IterationOutcome(1, {"r0": [2]}, finished_ids=["r0"], idle_rows={"kv_pool_full": 2}),
        IterationOutcome(1, {"r1": [1001]}, idle_rows={"queue_empty": 2}),
        IterationOutcome(2, {"r1": [1002], "r2": [2000]}, finished_ids=["r1"], idle_rows={"queue_empty": 1}),
        IterationOutcome(1, {"r2": [2001]}, finished_ids=["r2"], idle_rows={"queue_empty": 2}),
    ]
    continuous = time_continuous_run(
        lambda: outcomes.pop(0),
        lambda: bool(outcomes),
        request_ids=["r0", "r1", "r2"],
        max_num_seqs=3,
        clock=UnitClock(),
    )
    k = 0

    def forward() -> dict[str, int]:
        nonlocal k
        k += 1
        return {rid: token(rid, k - 1) for rid in ("r0", "r1", "r2")}

    static = time_static_run(forward, forward, max_tokens={"r0": 3, "r1": 3, "r2": 2}, clock=UnitClock())
    compare_batching(static, continuous)  # a valid pairing
    path = plot_batching(static, continuous, tmp_path / "synthetic.png")
    assert 20_000 < path.stat().st_size < 2_000_000
    height, width = matplotlib.image.imread(str(path)).shape[:2]
    assert width == 1300 and height > 400
