"""Scheduler with a fake runner: no model, no torch. The runner's token depends only on (request, position)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig, Reserve, SchedulerConfig
from tokenmill.core.sched_output import (
    IdleReason,
    ModelRunnerOutput,
    SampledToken,
    SchedulerOutput,
    StepRecord,
)
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

EOS = 2


def token_at(request_id: str, position: int) -> int:
    """The fake model: a token that depends only on the request and the position it is sampled for."""
    return 100 + zlib.crc32(f"{request_id}:{position}".encode()) % 10_000


@dataclass
class FakeRunner:
    """Checks each row against the request, then 'samples' ``token_at`` (or a scripted token). ``requests``: the
    table the runner reads requests from by id (as the engine's)."""

    block_size: int
    requests: Mapping[str, Request] = field(default_factory=dict)
    script: dict[str, list[int]] = field(default_factory=dict)  # request id -> output tokens to return
    logprobs: bool = False

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, SampledToken] = {}
        for row in out.rows:
            r = self.requests[row.request_id]
            assert row.start_position == r.num_computed_tokens
            assert row.token_ids == r.all_token_ids[row.start_position : row.seq_len]
            assert len(row.block_ids) * self.block_size >= row.seq_len
            assert row.sample == (row.seq_len == r.num_tokens)
            if row.sample:
                scripted = self.script.get(r.request_id)
                tok = scripted[r.num_output_tokens] if scripted else token_at(r.request_id, row.seq_len)
                sampled[r.request_id] = SampledToken(tok, logprob=-0.5 if self.logprobs else None)
        return ModelRunnerOutput(sampled=sampled)


@dataclass
class Run:
    records: list[StepRecord] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finish_step: dict[str, int] = field(default_factory=dict)  # request id -> 1-based step it ended in
    touched: list[list[str]] = field(default_factory=list)

    @property
    def batch_sizes(self) -> list[int]:
        return [r.batch_size for r in self.records]

    @property
    def token_slots(self) -> int:
        return sum(self.batch_sizes)

    def occupancy(self, max_num_seqs: int) -> float:
        return self.token_slots / (max_num_seqs * len(self.records))

    def idle(self, reason: IdleReason) -> int:
        return sum(r.idle_rows.get(reason, 0) for r in self.records)


def make_scheduler(
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 4096,
    reserve: Reserve = "none",
    max_num_preemptions: int = 32,
) -> Scheduler:
    kv = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks), reserve)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        reserve=reserve,
        max_num_preemptions=max_num_preemptions,
    )
    return Scheduler(config, kv, block_size)


def make_request(rid: str, prompt_len: int, max_tokens: int, **kw: object) -> Request:
    eos = kw.pop("eos_token_ids", frozenset({EOS}))
    params = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(rid, [10 + i for i in range(prompt_len)], params, eos_token_ids=eos)  # type: ignore[arg-type]


def step(sched: Scheduler, runner: FakeRunner, run: Run) -> SchedulerOutput:
    now_s = float(len(run.records) + 1)
    out = sched.schedule()
    sched.check_integrity()
    runner.requests = sched.requests
    touched = sched.update_from_output(out, runner.execute(out), now_s)
    sched.check_integrity()
    run.records.append(out.record)
    run.outputs.append(out)
    run.touched.append([r.request_id for r in touched])
    for r in touched:
        if r.is_finished:
            assert r.request_id not in run.finish_step, f"{r.request_id} reported finished twice"
            run.finish_step[r.request_id] = len(run.records)
    return out


def run_to_completion(
    sched: Scheduler,
    runner: FakeRunner,
    run: Run | None = None,
    max_steps: int = 10_000,
    before_step: Callable[[int], None] | None = None,
) -> Run:
    run = run or Run()
    while sched.has_unfinished():
        assert len(run.records) < max_steps, "scheduler made no progress"
        if before_step is not None:
            before_step(len(run.records))
        step(sched, runner, run)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return run


def seed_workload(long_first: bool = False) -> list[Request]:
    """Day 29/32: eight 5-token prompts, seven wanting 4 tokens, one wanting 32 (ignore_eos)."""
    shorts = [make_request(f"s{i}", 5, 4, ignore_eos=True) for i in range(7)]
    long = make_request("long", 5, 32, ignore_eos=True)
    return [long, *shorts] if long_first else [*shorts, long]


# --- the seed's workload -----------------------------------------------------------------------


def test_seed_workload_takes_32_iterations_and_60_token_slots() -> None:
    sched = make_scheduler(block_size=16, num_blocks=1000, max_num_seqs=8)
    requests = seed_workload()
    for r in requests:
        sched.add_request(r)
    run = run_to_completion(sched, FakeRunner(16))

    assert len(run.records) == 32
    assert run.batch_sizes == [8, 8, 8, 8] + [1] * 28
    assert run.token_slots == 60
    assert run.occupancy(8) == pytest.approx(60 / 256)  # the seed's 0.234
    first = run.records[0]
    assert (first.num_prefill_tokens, first.num_decode_tokens) == (40, 0)
    assert sorted(first.admitted_ids) == sorted(r.request_id for r in requests)
    assert all((r.num_prefill_tokens, r.num_decode_tokens) == (0, 8) for r in run.records[1:4])
    assert all((r.num_prefill_tokens, r.num_decode_tokens) == (0, 1) for r in run.records[4:])
    assert all(r.num_rows_possible == 8 for r in run.records)
    assert run.records[0].idle_rows == {}
    assert all(r.idle_rows == {IdleReason.QUEUE_EMPTY: 7} for r in run.records[4:])
    assert run.finish_step == {**{f"s{i}": 4 for i in range(7)}, "long": 32}
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.output_token_ids == [token_at(r.request_id, 5 + k) for k in range(r.num_output_tokens)]
        # The latency is stamped when the last token is sampled, not a step later.
        assert r.first_token_time_s == 1.0
        assert r.last_token_time_s == r.finished_time_s == run.finish_step[r.request_id]
        assert r.block_ids == [] and r.num_preemptions == 0
    assert sum(r.num_preemptions for r in run.records) == 0


def test_decode_rows_and_block_tables() -> None:
    sched = make_scheduler(block_size=4, max_num_seqs=2)
    r = make_request("a", 3, 8, ignore_eos=True)
    sched.add_request(r)
    runner, run = FakeRunner(4), Run()
    out = step(sched, runner, run)
    (row,) = out.rows
    assert (row.start_position, row.token_ids, row.sample, row.is_prefill) == (0, [10, 11, 12], True, True)
    assert row.block_ids == [0]
    out = step(sched, runner, run)
    (row,) = out.rows
    # Decode: the last sampled token, whose KV is not computed yet (num_computed_tokens = num_tokens - 1).
    assert row.token_ids == [r.output_token_ids[0]]
    assert (row.start_position, row.sample, row.is_prefill, row.block_ids) == (3, True, False, [0])
    out = step(sched, runner, run)
    assert out.rows[0].start_position == 4 and out.rows[0].block_ids == [0, 1]  # crossed a block boundary


# --- budgets -----------------------------------------------------------------------------------


def test_chunked_prefill_at_the_budget_boundary() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=10)
    a = make_request("a", 4, 5, ignore_eos=True)
    b = make_request("b", 20, 2, ignore_eos=True)
    c = make_request("c", 2, 2, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    runner, run = FakeRunner(4), Run()

    out = step(sched, runner, run)
    assert [(x.request_id, x.num_new_tokens, x.sample) for x in out.rows] == [("a", 4, True), ("b", 6, False)]
    assert out.record.admitted_ids == ["a", "b"]
    assert out.record.idle_rows == {IdleReason.TOKEN_BUDGET: 6}  # c waits: the budget is spent
    assert b.num_computed_tokens == 6 and b.num_output_tokens == 0

    out = step(sched, runner, run)
    assert [(x.request_id, x.start_position, x.num_new_tokens, x.sample) for x in out.rows] == [
        ("a", 4, 1, True),
        ("b", 6, 9, False),
    ]
    assert all(x.is_prefill for x in out.rows[1:])
    out = step(sched, runner, run)
    assert [(x.request_id, x.num_new_tokens, x.sample) for x in out.rows] == [
        ("a", 1, True),
        ("b", 5, True),
        ("c", 2, True),
    ]
    assert b.num_output_tokens == 1 and b.output_token_ids == [token_at("b", 20)]
    run_to_completion(sched, runner, run)
    assert b.output_token_ids == [token_at("b", 20), token_at("b", 21)]
    assert all(x.num_tokens <= 10 for x in run.outputs)


def test_max_num_seqs_bounds_rows_and_admission_is_fifo() -> None:
    sched = make_scheduler(max_num_seqs=3)
    requests = [make_request(f"r{i}", 2, 1 + i % 3, ignore_eos=True) for i in range(9)]
    for r in requests:
        sched.add_request(r)
    run = run_to_completion(sched, FakeRunner(16))
    assert max(run.batch_sizes) == 3
    admitted = [rid for rec in run.records for rid in rec.admitted_ids]
    assert admitted == [r.request_id for r in requests]
    for rec in run.records:
        assert sum(rec.idle_rows.values()) == 3 - rec.batch_size


def test_head_of_queue_blocks_the_rest() -> None:
    sched = make_scheduler(block_size=4, num_blocks=4, max_num_seqs=4)
    sched.add_request(make_request("a", 8, 4, ignore_eos=True))  # 2 blocks now
    sched.add_request(make_request("big", 12, 4, ignore_eos=True))  # 3 blocks now: does not fit
    sched.add_request(make_request("small", 1, 1, ignore_eos=True))  # would fit, must not overtake
    out = sched.schedule()
    assert [x.request_id for x in out.rows] == ["a"]
    assert out.record.idle_rows == {IdleReason.KV_POOL_FULL: 3}


def test_step_examines_only_the_head_of_a_long_queue() -> None:
    sched = make_scheduler(block_size=4, num_blocks=3, max_num_seqs=4)
    for i in range(2000):
        sched.add_request(make_request(f"r{i}", 8, 1))
    calls: list[str] = []
    real = sched.kv.allocate_slots

    def counting(
        request: Request, num_new_tokens: int, num_lookahead_blocks: int = 0, **kw: Any
    ) -> list[int] | None:
        calls.append(request.request_id)
        return real(request, num_new_tokens, num_lookahead_blocks, **kw)

    sched.kv.allocate_slots = counting  # type: ignore[method-assign]
    out = sched.schedule()
    assert [x.request_id for x in out.rows] == ["r0"]
    assert calls == ["r0", "r1"]


# --- stops -------------------------------------------------------------------------------------


def test_eos_stops_with_no_stop_reason_and_frees_blocks() -> None:
    sched = make_scheduler()
    r = make_request("a", 3, 10)
    sched.add_request(r)
    run = run_to_completion(sched, FakeRunner(16, script={"a": [7, 8, EOS, 9]}))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.output_token_ids == [7, 8, EOS]
    assert run.finish_step == {"a": 3} and r.finished_time_s == 3.0
    assert r.block_ids == []


def test_ignore_eos_and_min_tokens() -> None:
    sched = make_scheduler()
    ignoring = make_request("ign", 3, 4, ignore_eos=True)
    minimum = make_request("min", 3, 6, min_tokens=2)
    for r in (ignoring, minimum):
        sched.add_request(r)
    script = {"ign": [EOS] * 4, "min": [EOS, EOS, EOS, 5, 5, 5]}
    run_to_completion(sched, FakeRunner(16, script=script))
    assert ignoring.status is RequestStatus.FINISHED_LENGTH and ignoring.num_output_tokens == 4
    # Two tokens come before a stop token may end it: the third EOS stops it.
    assert minimum.status is RequestStatus.FINISHED_STOPPED and minimum.num_output_tokens == 3


def test_stop_token_ids_set_stop_reason() -> None:
    sched = make_scheduler()
    r = make_request("a", 3, 10, stop_token_ids=[42], ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, FakeRunner(16, script={"a": [EOS, 7, 42, 8]}))
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert r.output_token_ids == [EOS, 7, 42]
    assert r.finish_reason == "stop"


def test_max_model_len_ends_with_length() -> None:
    sched = make_scheduler(max_model_len=8)
    r = make_request("a", 5, 3, ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, FakeRunner(16))
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


def test_logprobs_are_kept_per_output_token() -> None:
    sched = make_scheduler()
    r = make_request("a", 3, 4, ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, FakeRunner(16, logprobs=True))
    assert len(r.output_logprobs) == 4
    assert all(isinstance(x, SampledToken) and x.logprob == -0.5 for x in r.output_logprobs)


def test_missing_sampled_token_is_a_bug() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, 4))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="no token"):
        sched.update_from_output(out, ModelRunnerOutput(sampled={}), 1.0)


def test_finishing_twice_is_a_bug() -> None:
    sched = make_scheduler()
    r = make_request("a", 3, 1)
    sched.add_request(r)
    run_to_completion(sched, FakeRunner(16))
    assert r.status is RequestStatus.FINISHED_LENGTH
    with pytest.raises(RuntimeError):
        sched._end(r, RequestStatus.FINISHED_STOPPED, None, 1.0)
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None


# --- add_request -------------------------------------------------------------------------------


def test_add_request_refuses_what_could_never_run() -> None:
    sched = make_scheduler(block_size=16, num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"90.*20.*110.*max_model_len \(100\)"):
        sched.add_request(make_request("long", 90, 20))
    # 60 + 10 = 70 tokens need 5 blocks of 16 but the pool has 4: refused now, never left to wait.
    with pytest.raises(ValueError, match=r"70 tokens need 5 KV blocks of 16.*has 4"):
        sched.add_request(make_request("big", 60, 10))
    sched.add_request(make_request("ok", 54, 10))  # 64 tokens: exactly the pool
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 1, 1))
    assert sched.num_waiting == 1


def test_mismatched_configs_are_refused() -> None:
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=8), "none")
    with pytest.raises(ValueError, match="reserve"):
        Scheduler(SchedulerConfig(reserve="worst_case"), kv, 16)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(), kv, 8)


# --- preemption --------------------------------------------------------------------------------


def pressure_workload() -> list[Request]:
    return [make_request(f"p{i}", 3 + i % 4, 10 + 3 * i, ignore_eos=True) for i in range(6)]


def run_workload(requests: list[Request], **kw: object) -> tuple[Scheduler, Run]:
    sched = make_scheduler(**kw)  # type: ignore[arg-type]
    for r in requests:
        sched.add_request(r)
    return sched, run_to_completion(sched, FakeRunner(sched.block_size))


def test_preemption_by_recompute_loses_and_duplicates_nothing() -> None:
    _, calm = run_workload(pressure_workload(), block_size=4, num_blocks=100)
    assert sum(r.num_preemptions for r in calm.records) == 0
    requests = pressure_workload()
    sched, tight = run_workload(requests, block_size=4, num_blocks=10)

    total = sum(r.num_preemptions for r in tight.records)
    assert total > 0
    assert (
        total == sum(len(r.preempted_ids) for r in tight.records) == sum(r.num_preemptions for r in requests)
    )
    # Same tokens for every request as without pressure: none lost, none sampled twice.
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [
            token_at(r.request_id, r.num_prompt_tokens + k) for k in range(r.num_output_tokens)
        ]
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert len(tight.records) > len(calm.records)
    assert sum(r.num_recomputed_tokens for r in tight.records) > 0
    assert sum(r.num_recomputed_tokens for r in calm.records) == 0


def test_preemption_victim_readmission_and_recompute() -> None:
    """Step by step on a tiny pool: who is preempted, what is recomputed, when it comes back."""
    sched = make_scheduler(block_size=4, num_blocks=3, max_num_seqs=4)
    a = make_request("a", 4, 6, ignore_eos=True)  # 10 tokens: 3 blocks at worst
    b = make_request("b", 3, 2, ignore_eos=True)
    c = make_request("c", 3, 5, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    runner, run = FakeRunner(4), Run()
    out = step(sched, runner, run)
    assert out.record.admitted_ids == ["a", "b", "c"] and sched.kv.num_free_blocks == 0
    # Step 2: a (4 computed + 1) needs a 2nd block; the pool is dry: c, the latest admitted, goes.
    out = step(sched, runner, run)
    assert out.record.preempted_ids == ["c"] and out.record.num_preemptions == 1
    assert [x.request_id for x in out.rows] == ["a", "b"]
    assert out.record.admitted_ids == []  # no admission in a step that preempted
    assert out.record.idle_rows == {IdleReason.PREEMPTED: 2}
    assert c.status is RequestStatus.WAITING and sched.waiting[0] is c
    assert c.num_computed_tokens == 0 and c.block_ids == [] and c.num_output_tokens == 1
    assert c.num_preemptions == 1
    assert b.status is RequestStatus.FINISHED_LENGTH  # b took its 2nd token and left, freeing a block
    # One block is free and c's re-prefill (prompt + 1 output = 4 tokens) fits in it, but c comes back
    # only when it can also make progress: room for its next block too (anti-thrash).
    out = step(sched, runner, run)
    assert [x.request_id for x in out.rows] == ["a"] and sched.kv.num_free_blocks == 1
    assert out.record.idle_rows == {IdleReason.KV_POOL_FULL: 3}
    assert c.status is RequestStatus.WAITING
    run_to_completion(sched, runner, run)
    first, back = [o for o in run.outputs if "c" in o.record.admitted_ids]
    assert first is run.outputs[0] and run.outputs.index(back) > 2
    (row,) = [x for x in back.rows if x.request_id == "c"]
    assert row.start_position == 0 and row.token_ids == c.prompt_token_ids + c.output_token_ids[:1]
    assert row.is_prefill and row.sample
    assert back.record.num_recomputed_tokens == 3  # the prompt again; the output token was never computed
    assert c.output_token_ids == [token_at("c", 3 + k) for k in range(5)]
    assert a.num_preemptions == 0


def test_no_admission_in_a_step_that_preempted() -> None:
    requests = [make_request(f"q{i}", 2 + i % 5, 8 + i, ignore_eos=True) for i in range(12)]
    _, run = run_workload(requests, block_size=2, num_blocks=12, max_num_seqs=6)
    preempting = [r for r in run.records if r.num_preemptions]
    assert preempting
    for rec in preempting:
        assert rec.admitted_ids == []
        assert set(rec.idle_rows) <= {IdleReason.PREEMPTED, IdleReason.TOKEN_BUDGET, IdleReason.QUEUE_EMPTY}
        assert rec.idle_rows.get(IdleReason.PREEMPTED, 0) > 0
    for rec in run.records:
        assert sum(rec.idle_rows.values()) == 6 - rec.batch_size


def test_preemption_bound_aborts_with_an_error() -> None:
    requests = [make_request(f"q{i}", 2 + i % 5, 8 + i, ignore_eos=True) for i in range(12)]
    sched, run = run_workload(requests, block_size=2, num_blocks=12, max_num_seqs=6, max_num_preemptions=1)
    aborted = [r for r in requests if r.status is RequestStatus.FINISHED_ABORTED]
    assert aborted
    for r in aborted:
        assert r.num_preemptions == 2
        assert r.error is not None and "preempted 2 times" in r.error and "max_num_preemptions=1" in r.error
        assert r.error_kind == "overloaded"
        assert r.finish_reason == "error"
        assert r.block_ids == [] and r.num_computed_tokens == 0
        (out,) = [o for o in run.outputs if r.request_id in o.finished_ids]
        assert r.request_id in out.record.preempted_ids
        assert r.request_id in run.finish_step  # reported by update_from_output, exactly once
    for r in requests:
        assert r.is_finished and r.num_preemptions <= 2
    assert not sched.has_unfinished()


# --- abort -------------------------------------------------------------------------------------


def test_abort_waiting_running_and_preempted() -> None:
    sched = make_scheduler(block_size=4, num_blocks=3, max_num_seqs=4)
    a = make_request("a", 4, 6, ignore_eos=True)
    b = make_request("b", 3, 5, ignore_eos=True)
    c = make_request("c", 3, 5, ignore_eos=True)
    w = make_request("w", 9, 2, ignore_eos=True)  # 3 blocks now: waits behind the others
    for r in (a, b, c, w):
        sched.add_request(r)
    runner, run = FakeRunner(4), Run()
    step(sched, runner, run)
    assert w.status is RequestStatus.WAITING
    step(sched, runner, run)  # a grows, c is preempted
    assert c.status is RequestStatus.WAITING and c.num_preemptions == 1

    for victim in (w, c, b):  # waiting, preempted, running
        free_before = sched.kv.num_free_blocks
        held = len(victim.block_ids)
        got = sched.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED, now_s=9.0)
        assert got is victim and victim.status is RequestStatus.FINISHED_ABORTED
        assert victim.finished_time_s == 9.0 and victim.error is None
        assert victim.block_ids == [] and sched.kv.num_free_blocks == free_before + held
        assert sched.get_request(victim.request_id) is None
        assert sched.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED) is None  # once only
        sched.check_integrity()
    assert sched.num_waiting == 0 and sched.num_running == 1
    run_to_completion(sched, runner, run)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert sched.finish_request("nobody", RequestStatus.FINISHED_ABORTED) is None


def test_abort_between_schedule_and_update() -> None:
    sched = make_scheduler()
    a, b = make_request("a", 3, 4, ignore_eos=True), make_request("b", 3, 4, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(16, requests=sched.requests)
    out = sched.schedule()
    runner_output = runner.execute(out)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    touched = sched.update_from_output(out, runner_output, 1.0)
    assert touched == [b]
    assert a.num_output_tokens == 0 and a.block_ids == []
    sched.check_integrity()


def test_finish_request_for_a_stop_string_and_bad_status() -> None:
    sched = make_scheduler()
    r = make_request("a", 3, 10)
    sched.add_request(r)
    runner, run = FakeRunner(16), Run()
    step(sched, runner, run)
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="###", now_s=2.0) is r
    assert r.stop_reason == "###" and r.finish_reason == "stop" and sched.kv.num_free_blocks == 1000
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_request("a", RequestStatus.RUNNING)
    assert not sched.has_unfinished()


# --- Week 9: worst-case reservations against incremental allocation ---------------------------


def test_week9_worst_case_reservations_leave_rows_idle() -> None:
    """The seed's closing measurement: a pool sized for four reservations of 1 block each.

    With worst-case admission the 3-block request waits behind reservations until two waves of short
    requests are gone (the seed's 40 iterations + 1 reap, occupancy 0.188); with incremental allocation
    it needs one block to start and runs alongside the second wave.
    """
    results = {}
    for reserve in ("worst_case", "none"):
        sched = make_scheduler(block_size=16, num_blocks=4, max_num_seqs=8, reserve=reserve)
        requests = seed_workload()
        for r in requests:
            sched.add_request(r)
        run = run_to_completion(sched, FakeRunner(16))
        assert run.token_slots == 60
        assert all(
            r.output_token_ids == [token_at(r.request_id, 5 + k) for k in range(r.num_output_tokens)]
            for r in requests
        )
        results[reserve] = run
    wc, inc = results["worst_case"], results["none"]
    assert len(inc.records) < len(wc.records)
    assert inc.occupancy(8) > wc.occupancy(8)
    assert wc.idle(IdleReason.KV_RESERVED) > 0
    assert inc.idle(IdleReason.KV_RESERVED) == 0
    assert sum(r.num_preemptions for r in wc.records) == 0
    # The numbers, pinned (they are counts, so they hold on any machine).
    assert (len(wc.records), len(inc.records)) == (40, 36)
    assert wc.occupancy(8) == pytest.approx(60 / 320)
    assert inc.occupancy(8) == pytest.approx(60 / 288)
    assert sum(r.num_preemptions for r in inc.records) == 0
    assert wc.finish_step["long"] == 40 and inc.finish_step["long"] == 36


def test_week9_reservations_cost_nothing_when_the_pool_holds_every_worst_case() -> None:
    """12 blocks of 16: the worst cases sum to 3 + 7 * 1 = 10 blocks, so both policies run the seed's 32."""
    lengths = {}
    for reserve in ("worst_case", "none"):
        sched = make_scheduler(block_size=16, num_blocks=12, max_num_seqs=8, reserve=reserve)
        for r in seed_workload():
            sched.add_request(r)
        run = run_to_completion(sched, FakeRunner(16))
        assert run.idle(IdleReason.KV_RESERVED) == 0
        lengths[reserve] = len(run.records)
    assert lengths == {"worst_case": 32, "none": 32}


def test_kv_reserved_when_reservations_hold_unused_blocks() -> None:
    sched = make_scheduler(block_size=16, num_blocks=8, reserve="worst_case")
    for r in seed_workload(long_first=True):  # long books 3 blocks and uses 1
        sched.add_request(r)
    out = sched.schedule()
    assert out.record.batch_size == 6
    assert out.record.idle_rows == {IdleReason.KV_RESERVED: 2}
    assert sched.kv.num_reserved_unused_blocks == 2 and sched.kv.usage == 1.0


def test_failed_step_ends_its_rows_and_still_reports_requests_ended_in_schedule() -> None:
    requests = [make_request(f"q{i}", 2 + i % 5, 8 + i, ignore_eos=True) for i in range(12)]
    sched = make_scheduler(block_size=2, num_blocks=12, max_num_seqs=6, max_num_preemptions=1)
    for r in requests:
        sched.add_request(r)
    runner, reported = FakeRunner(block_size=2, requests=sched.requests), []
    failed_once = False
    for now in range(1, 500):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        if out.finished_ids and not failed_once:  # the forward of a step that also ended requests fails
            failed_once = True
            scheduled = [sched.requests[row.request_id] for row in out.rows]
            touched = sched.fail_step(out, "the step failed: boom", float(now))
            rows = {row.request_id for row in out.rows}
            assert {r.request_id for r in touched} == rows | set(out.finished_ids)
            for request in scheduled:
                assert request.finish_reason == "error" and request.error == "the step failed: boom"
                assert request.error_kind == "step_failed"
                assert request.block_ids == []
        else:
            touched = sched.update_from_output(out, runner.execute(out), float(now))
        sched.check_integrity()
        reported += [r.request_id for r in touched if r.is_finished]
    assert failed_once, "the workload was meant to hit the preemption bound"
    assert sorted(reported) == sorted(r.request_id for r in requests)  # every request ends exactly once
    assert sched.kv.num_free_blocks == 12


def test_the_schedule_is_plain_data_that_pickles() -> None:
    """The contract with the runner carries ids, tokens, positions and blocks, never a live Request: tensor
    parallelism broadcasts these very rows to its workers."""
    import dataclasses
    import pickle

    sched = make_scheduler()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 5 + i, 4))
    out = sched.schedule()
    assert len(out.rows) == 3
    for row in out.rows:
        values = [getattr(row, f.name) for f in dataclasses.fields(row)]
        assert not any(isinstance(v, Request) for v in values)
    again = pickle.loads(pickle.dumps(out))
    assert again.rows == out.rows and again.record == out.record
    assert [row.request_id for row in again.rows] == ["r0", "r1", "r2"]
