"""Property tests: random add / step / abort sequences against the scheduler and the KV-cache manager.

After every step the integrity checks hold; run to completion, every request ends exactly once, its
tokens are exactly the fake model's (none lost or duplicated by preemption) and every block is back.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

EOS_IDS = frozenset(range(100, 400))  # ~3% of the fake model's tokens


def token_at(request_id: str, position: int) -> int:
    return 100 + zlib.crc32(f"{request_id}:{position}".encode()) % 10_000


def fake_execute(
    out: SchedulerOutput, block_size: int, requests: Mapping[str, Request], kv: KVCacheManager | None = None
) -> ModelRunnerOutput:
    sampled = {}
    verified = {}
    for row in out.rows:
        r = requests[row.request_id]
        assert row.start_position == r.num_computed_tokens
        num_known = row.num_new_tokens - row.num_spec_tokens  # the row's tokens the request already has
        assert (
            row.token_ids[:num_known] == r.all_token_ids[row.start_position : row.start_position + num_known]
        )
        assert len(row.block_ids) * block_size >= row.seq_len
        if (
            kv is not None
        ):  # the blocks this row writes are its own: no other table, not findable in the cache
            for b in row.block_ids[row.start_position // block_size : -(-row.seq_len // block_size)]:
                assert kv.pool.ref_count(b) == 1, f"row {r.request_id} writes shared block {b}"
                assert not kv.pool.is_cached(b), f"row {r.request_id} writes cached block {b}"
        assert row.sample == (row.start_position + num_known == r.num_tokens)
        if row.num_spec_tokens:  # greedy verification against the fake model's tokens
            assert row.sample and not row.is_prefill and num_known == 1
            assert row.num_spec_tokens < r.sampling_params.max_tokens - r.num_output_tokens
            kept = []
            for j, token in enumerate(row.spec_token_ids):
                if token != token_at(r.request_id, r.num_tokens + j):
                    break
                kept.append(SampledToken(token))
            kept.append(SampledToken(token_at(r.request_id, r.num_tokens + len(kept))))
            verified[r.request_id] = kept
        elif row.sample:
            sampled[r.request_id] = SampledToken(token_at(r.request_id, row.seq_len))
    return ModelRunnerOutput(sampled=sampled, verified=verified)


class FakeProposer:
    """Proposes 1-4 tokens for a decoding request, each right (the fake model's) or wrong by a hash."""

    def __init__(self) -> None:
        self.forgotten: set[str] = set()
        self.num_proposed = 0

    def propose(self, request: Request, max_num_tokens: int, num_running: int) -> list[int]:
        assert max_num_tokens >= 1
        n = min(max_num_tokens, 1 + zlib.crc32(f"n{request.request_id}:{request.num_tokens}".encode()) % 4)
        out = []
        for j in range(n):
            right = token_at(request.request_id, request.num_tokens + j)
            wrong = zlib.crc32(f"w{request.request_id}:{request.num_tokens + j}".encode()) % 5 == 0
            out.append(right + 1 if wrong else right)
        self.num_proposed += len(out)
        return out

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_proposed

    def forget(self, request_id: str) -> None:
        self.forgotten.add(request_id)


@dataclass
class Harness:
    sched: Scheduler
    block_size: int
    requests: dict[str, Request]
    ended: dict[str, int]
    now_s: float = 0.0

    def note_ended(self, request: Request) -> None:
        self.ended[request.request_id] = self.ended.get(request.request_id, 0) + 1

    def step(self, abort_in_flight: int | None = None) -> None:
        sched, cfg = self.sched, self.sched.config
        running_before = [r.request_id for r in sched.running]
        out = sched.schedule()
        rec = out.record
        sched.check_integrity()
        assert len(out.rows) == rec.batch_size <= cfg.max_num_seqs
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert sum(rec.idle_rows.values()) == cfg.max_num_seqs - rec.batch_size
        assert all(n > 0 for n in rec.idle_rows.values())
        assert len({row.request_id for row in out.rows}) == len(out.rows)
        if rec.num_preemptions:
            event("a step preempted")
            assert rec.admitted_ids == []
            # Victims are the most recently admitted of those running when the step began.
            assert rec.preempted_ids == running_before[::-1][: rec.num_preemptions]
        if out.finished_ids:
            assert set(out.finished_ids) <= set(rec.preempted_ids)
        for reason in rec.idle_rows:
            event(f"idle: {reason.name}")
        if rec.num_prefix_hit_tokens:
            event("a prefix-cache hit")
            assert rec.num_prefix_hit_tokens % self.block_size == 0
        if cfg.reserve == "worst_case":
            assert rec.num_preemptions == 0  # growth always comes out of the request's reservation
        else:
            assert sched.kv.num_reserved_unused_blocks == 0
        runner_output = fake_execute(out, self.block_size, sched.requests, sched.kv)
        if abort_in_flight is not None and self.requests:
            ids = sorted(self.requests)
            got = sched.finish_request(ids[abort_in_flight % len(ids)], RequestStatus.FINISHED_ABORTED)
            if got is not None:
                self.note_ended(got)
        self.now_s += 1.0
        for r in sched.update_from_output(out, runner_output, self.now_s):
            if r.is_finished:
                self.note_ended(r)
        sched.check_integrity()


add_op = st.tuples(
    st.just("add"),
    st.integers(1, 24),  # prompt length
    st.integers(1, 16),  # max_tokens
    st.booleans(),  # ignore_eos
    st.integers(0, 2),  # prompt family: prompts of one family are prefixes of one another
)
step_op = st.tuples(st.just("step"), st.none() | st.integers(0, 1000))  # optional abort mid-step
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000))
ops_strategy = st.lists(st.one_of(add_op, add_op, step_op, step_op, abort_op), min_size=4, max_size=60)


def drive(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    reserve: str,
    max_num_preemptions: int,
    ops: list[tuple[object, ...]],
    enable_caching: bool = False,
    speculate: bool = False,
) -> None:
    """Apply ``ops``, run to completion, and check the end state. ``speculate``: decode rows carry proposals
    (FakeProposer) that the fake runner verifies; the tokens must still be exactly the fake model's."""
    kv = KVCacheManager(
        CacheConfig(block_size=block_size, num_blocks=num_blocks),
        reserve,  # type: ignore[arg-type]
        enable_caching=enable_caching,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        reserve=reserve,  # type: ignore[arg-type]
        max_num_preemptions=max_num_preemptions,
    )
    proposer = FakeProposer() if speculate else None
    h = Harness(Scheduler(config, kv, block_size, proposer), block_size, {}, {})  # type: ignore[arg-type]
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, ignore_eos, *family = op
            assert isinstance(prompt_len, int) and isinstance(max_tokens, int)
            rid = f"r{len(h.requests)}"
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=bool(ignore_eos))
            f = int(family[0]) if family else 0  # type: ignore[call-overload]
            prompt = [7 + 1000 * f + i % (3 + f) for i in range(prompt_len)]
            req = Request(rid, prompt, params, eos_token_ids=EOS_IDS)
            fits_len = prompt_len + max_tokens <= max_model_len
            fits_pool = -(-(prompt_len + max_tokens) // block_size) <= num_blocks
            try:
                h.sched.add_request(req)
            except ValueError:
                assert not (fits_len and fits_pool)
            else:
                assert fits_len and fits_pool
                h.requests[rid] = req
        elif op[0] == "step":
            abort = op[1]
            assert abort is None or isinstance(abort, int)
            h.step(abort)
        else:
            index = op[1]
            assert isinstance(index, int)
            if h.requests:
                ids = sorted(h.requests)
                got = h.sched.finish_request(ids[index % len(ids)], RequestStatus.FINISHED_ABORTED)
                if got is not None:
                    h.note_ended(got)
                h.sched.check_integrity()

    # Run to completion: the scheduler must always make progress.
    limit = 50 + sum(r.max_num_tokens * (max_num_preemptions + 2) for r in h.requests.values())
    steps = 0
    while h.sched.has_unfinished():
        h.step()
        steps += 1
        assert steps <= limit, "no progress"

    assert h.ended == {rid: 1 for rid in h.requests}
    for rid, r in h.requests.items():
        assert r.is_finished and r.block_ids == [] and r.num_reserved_blocks == 0
        assert r.num_output_tokens <= r.sampling_params.max_tokens
        assert r.output_token_ids == [
            token_at(rid, r.num_prompt_tokens + k) for k in range(r.num_output_tokens)
        ]
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= max_model_len
        elif r.status is RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] in EOS_IDS and not r.sampling_params.ignore_eos
        elif r.error is not None:
            event("preemption bound hit")
            assert r.num_preemptions == max_num_preemptions + 1
        if r.status is not RequestStatus.FINISHED_ABORTED:
            assert r.finished_time_s == r.last_token_time_s
    assert kv.num_free_blocks == num_blocks
    assert kv.pool.num_free_blocks == num_blocks
    assert kv.num_reserved_unused_blocks == 0 and kv.usage == 0.0
    assert kv.num_tracked_requests == 0
    kv.check_integrity()
    if proposer is not None:
        assert proposer.forgotten == set(h.requests)  # every request's proposer state dropped at its end
        if proposer.num_proposed:
            event("proposals verified")


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(2, 24),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 48),
    max_model_len=st.integers(8, 40),
    reserve=st.sampled_from(["none", "worst_case"]),
    max_num_preemptions=st.integers(1, 4),
    ops=ops_strategy,
)
def test_random_workloads_keep_every_invariant(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    reserve: str,
    max_num_preemptions: int,
    ops: list[tuple[object, ...]],
) -> None:
    drive(
        block_size,
        num_blocks,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        reserve,
        max_num_preemptions,
        ops,
    )


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2]),
    num_blocks=st.integers(8, 16),
    max_num_seqs=st.integers(3, 8),
    max_num_batched_tokens=st.integers(4, 32),
    reserve=st.sampled_from(["none", "none", "worst_case"]),
    max_num_preemptions=st.integers(1, 3),
    burst=st.lists(
        st.tuples(st.just("add"), st.integers(1, 6), st.integers(2, 10), st.just(True)),
        min_size=3,
        max_size=10,
    ),
    ops=ops_strategy,
)
def test_pressure_preempts_and_keeps_every_invariant(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    reserve: str,
    max_num_preemptions: int,
    burst: list[tuple[object, ...]],
    ops: list[tuple[object, ...]],
) -> None:
    """A burst of small requests that fit one at a time but not together: preemption territory."""
    drive(
        block_size,
        num_blocks,
        max_num_seqs,
        max_num_batched_tokens,
        32,
        reserve,
        max_num_preemptions,
        [*burst, *ops],
    )


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(4, 24),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 48),
    reserve=st.sampled_from(["none", "none", "worst_case"]),
    max_num_preemptions=st.integers(1, 4),
    ops=ops_strategy,
)
def test_prefix_caching_keeps_every_invariant(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    reserve: str,
    max_num_preemptions: int,
    ops: list[tuple[object, ...]],
) -> None:
    """Prompts of three families share prefixes of every length (a block, one short of one, one over):
    with caching on, the same invariants, tokens and end state; no row writes a shared or cached block;
    at the end every block is free (cached ones evictable, still mapped)."""
    drive(
        block_size, num_blocks, max_num_seqs, max_num_batched_tokens, 40, reserve, max_num_preemptions, ops,
        enable_caching=True,
    )  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(3, 20),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 48),
    reserve=st.sampled_from(["none", "none", "worst_case"]),
    max_num_preemptions=st.integers(1, 4),
    enable_caching=st.booleans(),
    burst=st.lists(
        st.tuples(st.just("add"), st.integers(1, 6), st.integers(2, 12), st.just(True), st.integers(0, 2)),
        min_size=2,
        max_size=8,
    ),
    ops=ops_strategy,
)
def test_speculation_keeps_every_invariant(
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    reserve: str,
    max_num_preemptions: int,
    enable_caching: bool,
    burst: list[tuple[object, ...]],
    ops: list[tuple[object, ...]],
) -> None:
    """Speculative decoding under a tight pool: rows of 1 + k tokens, rejected tokens' blocks given back every
    step. Integrity after every step, the fake model's tokens exactly (none past max_tokens or a stop token),
    no row writing a shared or cached block, every block back at the end."""
    drive(
        block_size, num_blocks, max_num_seqs, max_num_batched_tokens, 40, reserve, max_num_preemptions,
        [*burst, *ops], enable_caching=enable_caching, speculate=True,
    )  # fmt: skip
