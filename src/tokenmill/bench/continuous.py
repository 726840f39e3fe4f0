"""The continuous side on a real :class:`Engine`, and one workload run both ways back to back on one clock.

:func:`build_continuous_run` wires :func:`time_continuous_run`'s three closures to an engine::

    admit(request_id)  ->  engine.add_request(prompt ids, greedy params, request_id)
    iterate()          ->  engine.step(): tokens from the deltas, finishes from the deltas (the engine frees a
                           request in the iteration that sampled its last token), and from the step's
                           StepRecord the batch size, the preemptions and the idle rows by reason
    has_work()         ->  engine.has_unfinished()

:func:`compare_model_batching` loads the model once, runs the static batch, then the engine, on one clock, and
pairs them with :func:`compare_batching` (which refuses the pairing unless the text is identical).
:func:`compare_reserve` runs the engine twice over one pool, ``reserve="worst_case"`` against ``"none"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.bench.static import StaticBatch, greedy_params, time_batched_decode
from tokenmill.bench.timing import (
    BatchingComparison,
    BatchTiming,
    Clock,
    ContinuousTiming,
    IterationOutcome,
    UnitClock,
    WallClock,
    compare_batching,
    time_continuous_run,
)
from tokenmill.bench.workload import ResolvedRequest, Workload, resolve_workload
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import StepRecord
from tokenmill.outputs import RequestOutput


@dataclass
class ContinuousRun:
    """The closures over one engine, and what the engine emitted while they ran."""

    engine: Any
    requests: dict[str, ResolvedRequest]
    outputs: dict[str, RequestOutput] = field(default_factory=dict)  # each request's final output, as emitted
    records: list[StepRecord] = field(default_factory=list)  # every step's record, empty steps included

    def admit(self, request_id: str) -> None:
        r = self.requests[request_id]
        self.engine.add_request(list(r.prompt_token_ids), greedy_params(r.max_tokens), request_id=request_id)

    def iterate(self) -> IterationOutcome:
        result = self.engine.step()
        self.records.append(result.record)
        for output in result.finished:
            self.outputs[output.request_id] = output
        record = result.record
        return IterationOutcome(
            batch_size=record.batch_size,
            new_tokens={d.request_id: list(d.new_token_ids) for d in result.deltas if d.new_token_ids},
            finished_ids=[d.request_id for d in result.deltas if d.finished],
            preempted_ids=list(record.preempted_ids),
            idle_rows={reason.value: n for reason, n in record.idle_rows.items()},
        )

    def has_work(self) -> bool:
        return bool(self.engine.has_unfinished())


def build_continuous_run(engine: Any, requests: Sequence[ResolvedRequest]) -> ContinuousRun:
    """Closures over ``engine`` for ``requests``; the engine should be idle and built on the timing clock."""
    if engine.has_unfinished():
        raise ValueError("the engine already has unfinished requests: a benchmark needs it to itself")
    by_id = {r.request_id: r for r in requests}
    if len(by_id) != len(requests):
        raise ValueError("request ids must be unique")
    return ContinuousRun(engine=engine, requests=by_id)


def time_engine_run(engine: Any, requests: Sequence[ResolvedRequest], clock: Clock) -> ContinuousTiming:
    """Run ``requests`` through ``engine`` under :func:`time_continuous_run` (arrivals admitted on time)."""
    run = build_continuous_run(engine, requests)
    return _time(run, requests, clock)


def _time(run: ContinuousRun, requests: Sequence[ResolvedRequest], clock: Clock) -> ContinuousTiming:
    return time_continuous_run(
        run.iterate,
        run.has_work,
        request_ids=[r.request_id for r in requests],
        max_num_seqs=run.engine.config.max_num_seqs,
        clock=clock,
        arrival_time_s={r.request_id: r.arrival_time_s for r in requests},
        admit=run.admit,
    )


@dataclass
class ModelBatchingResult:
    static: BatchTiming
    continuous: ContinuousTiming
    comparison: BatchingComparison
    outputs: dict[str, RequestOutput]  # what the engine emitted, per request
    engine_stats: dict[str, object]
    requests: list[ResolvedRequest]
    model_name: str
    device: str
    dtype: str
    num_kv_blocks: int  # the engine's pool
    roofline_limits: str | None = None  # the machine's limits the engine's roofline used (--hardware-limits)


def load_for_bench(config: EngineConfig) -> Any:
    """The model and tokenizer once, for every engine and static batch of a benchmark."""
    from tokenmill.model.loader import load_model

    return load_model(config.model, device=config.device, dtype=config.dtype)


def compare_model_batching(
    workload: Workload,
    config: EngineConfig | None = None,
    *,
    clock: Clock | None = None,
    loaded: Any = None,
    warmup: bool = True,
) -> ModelBatchingResult:
    """Run ``workload`` as a static batch, then through a fresh Engine, back to back on one clock; pair them.

    ``config.max_num_seqs`` is the engine's width; a benchmark usually sets it to the workload's size, the
    static batch's width. Without ``config.num_kv_blocks`` the engine's pool holds every request's worst case at
    once (what the static batch books), so the engine never preempts. ``warmup`` runs one untimed two-token
    forward first so neither side pays the one-time costs. Raises ``ValueError`` (from
    :func:`compare_batching`) if the two runs' text differs.
    """
    from tokenmill.engine import Engine

    config = config or EngineConfig(max_num_seqs=len(workload))
    clock = clock or WallClock()
    if loaded is None:
        loaded = load_for_bench(config)
    tokenizer = loaded.tokenizer
    requests = resolve_workload(workload, tokenizer.encode, tokenizer.vocab_size)
    if config.num_kv_blocks is None:
        config = replace(
            config, num_kv_blocks=sum(_worst_case_blocks(r, config.block_size) for r in requests)
        )
    engine = Engine(config, clock=clock.now, loaded=loaded)
    if warmup:
        _warm_up(loaded, requests[0], config.block_size)
    static = time_batched_decode(
        loaded, requests, clock=clock, block_size=config.block_size, seed=config.seed
    )
    run = build_continuous_run(engine, requests)
    continuous = _time(run, requests, clock)
    return ModelBatchingResult(
        static=static,
        continuous=continuous,
        comparison=compare_batching(static, continuous),
        outputs=run.outputs,
        engine_stats=engine.stats.as_dict(),
        requests=requests,
        model_name=engine.model_name,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        num_kv_blocks=engine.num_total_blocks,
        roofline_limits=engine.roofline.limits.describe() if engine.roofline is not None else None,
    )


def _worst_case_blocks(request: ResolvedRequest, block_size: int) -> int:
    return -(-(len(request.prompt_token_ids) + request.max_tokens) // block_size)


def _warm_up(loaded: Any, request: ResolvedRequest, block_size: int) -> None:
    batch = StaticBatch(loaded, [replace(request, max_tokens=2, arrival_time_s=0.0)], block_size=block_size)
    batch.prefill()
    batch.decode_step()


@dataclass
class ReserveComparison:
    num_kv_blocks: int
    block_size: int
    timings: dict[str, ContinuousTiming]  # reserve policy -> its run

    def to_dict(self) -> dict[str, object]:
        return {
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "runs": {policy: t.to_dict() for policy, t in self.timings.items()},
        }


def default_reserve_pool(requests: Sequence[ResolvedRequest], block_size: int) -> int:
    """The seed's Week-9 pool: room for four worst-case reservations of a typical (median) request, and never
    less than the largest request's worst case (it could not run at all). Seed workload, blocks of 16: 4."""
    worst = sorted(_worst_case_blocks(r, block_size) for r in requests)
    return max(4 * worst[len(worst) // 2], worst[-1])


def compare_reserve(
    workload: Workload,
    config: EngineConfig,
    *,
    num_kv_blocks: int | None = None,
    clock_factory: Any = None,
    loaded: Any = None,
    warmup: bool = True,
) -> ReserveComparison:
    """The same workload through one pool twice: worst-case reservations against incremental allocation.

    ``clock_factory()`` gives each run a fresh clock (default :class:`WallClock`; pass ``UnitClock`` to count
    iterations). ``warmup`` as in :func:`compare_model_batching`. Raises ``ValueError`` if the two runs' text
    differs (same greedy model, same tokens expected).
    """
    from tokenmill.engine import Engine

    clock_factory = clock_factory or WallClock
    if loaded is None:
        loaded = load_for_bench(config)
    tokenizer = loaded.tokenizer
    requests = resolve_workload(workload, tokenizer.encode, tokenizer.vocab_size)
    blocks = num_kv_blocks or config.num_kv_blocks or default_reserve_pool(requests, config.block_size)
    if warmup:
        _warm_up(loaded, requests[0], config.block_size)
    timings: dict[str, ContinuousTiming] = {}
    for policy in ("worst_case", "none"):
        clock: Clock = clock_factory()
        engine = Engine(replace(config, num_kv_blocks=blocks, reserve=policy), clock=clock.now, loaded=loaded)
        timings[policy] = time_engine_run(engine, requests, clock)
    a, b = timings["worst_case"], timings["none"]
    for r in requests:
        if a.tokens[r.request_id] != b.tokens[r.request_id]:
            raise ValueError(
                f"request {r.request_id!r}: reserve=worst_case and reserve=none collected different text"
            )
    return ReserveComparison(num_kv_blocks=blocks, block_size=config.block_size, timings=timings)


__all__ = [
    "ContinuousRun",
    "ModelBatchingResult",
    "ReserveComparison",
    "UnitClock",
    "build_continuous_run",
    "compare_model_batching",
    "compare_reserve",
    "default_reserve_pool",
    "time_engine_run",
]
