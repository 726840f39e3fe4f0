"""``tokenmill bench replay FILE``: a recorded day of traffic (``tokenmill serve --record``) run again.

Under the unit clock (the default) the real :class:`~tokenmill.core.scheduler.Scheduler` and block pool run every
recorded request with a fake model (no weights): each request arrives at its recorded ``arrival_iteration``, has
its recorded prompt length, shares prefix blocks exactly where the recorded prompts did (``traffic.prefix_keys``:
synthetic tokens drawn per key), and ends after its recorded number of output tokens (the fake model's end of
sequence; its ``max_tokens``, what worst-case reservations book, is the recorded one). What comes out is counts,
true on any machine: iterations, token-slots, occupancy, idle rows by reason, preemptions, recomputed tokens,
prefix-cache hits, and queueing and latency in iterations. What-if configurations (another pool size, batch
width, token budget, reservation policy, prefix caching off) run the same requests, side by side in one table.

With ``--live URL`` it replays against a running server instead, each request sent at its recorded arrival time
(``/v1/completions`` with the recorded length of synthetic token ids, or the recorded text with
``--record-text``; ``max_tokens`` the recorded output length, ``ignore_eos``): times, TTFT / TPOT / end-to-end
percentiles, as ``tokenmill bench serve`` reports them.

A recorded request that ended before its first token (aborted or failed while it waited) is not replayed; the
report counts them. One that was aborted later is replayed as ending at its recorded length.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.bench.timing import ContinuousTiming, IterationOutcome, UnitClock, time_continuous_run
from tokenmill.cache.kv_cache_manager import KVCacheManager
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SampledToken, SchedulerOutput, StepRecord
from tokenmill.core.scheduler import Scheduler
from tokenmill.measure.traffic import Traffic, TrafficRequest, read_traffic, synthetic_prompt
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

END_OF_SEQUENCE = 1  # the fake model's end-of-sequence token
FILLER = 7  # every other token it samples


@dataclass(frozen=True)
class ReplayConfig:
    """The scheduler and pool settings a replay runs under (the recording's header, or a what-if)."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    reserve: str = "none"
    enable_prefix_caching: bool = True

    @classmethod
    def of(cls, traffic: Traffic) -> ReplayConfig:
        c = traffic.config
        return cls(
            block_size=int(c["block_size"]),
            num_kv_blocks=int(c["num_kv_blocks"]),
            max_num_seqs=int(c["max_num_seqs"]),
            max_num_batched_tokens=int(c["max_num_batched_tokens"]),
            max_model_len=int(c["max_model_len"]),
            reserve=str(c["reserve"]),
            enable_prefix_caching=bool(c["enable_prefix_caching"]),
        )

    def with_changes(self, changes: dict[str, Any]) -> ReplayConfig:
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown what-if settings {sorted(unknown)}; known: {sorted(self.__dataclass_fields__)}"
            )
        return dataclasses.replace(self, **changes)


def parse_what_if(text: str) -> dict[str, Any]:
    """``"num_kv_blocks=128,reserve=worst_case"`` -> {"num_kv_blocks": 128, "reserve": "worst_case"}."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"a what-if is KEY=VALUE[,KEY=VALUE...], got {text!r}")
        if key == "enable_prefix_caching":
            if value.lower() not in ("true", "false"):
                raise ValueError(f"enable_prefix_caching must be true or false, got {value!r}")
            out[key] = value.lower() == "true"
        elif key == "reserve":
            out[key] = value
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {value!r}") from None
    return out


@dataclass
class ReplayResult:
    label: str
    config: ReplayConfig
    timing: ContinuousTiming
    records: list[StepRecord]
    queue_iterations: dict[str, float]  # request id -> iterations from arrival to first admission
    num_replayed: int
    num_refused: int  # could never run under this configuration (larger than the pool, or max_model_len)
    num_skipped: int  # ended before their first token in the recording
    num_computed_tokens: int = 0

    @property
    def num_recomputed_tokens(self) -> int:
        return sum(r.num_recomputed_tokens for r in self.records)

    @property
    def num_prefix_hit_tokens(self) -> int:
        return sum(r.num_prefix_hit_tokens for r in self.records)

    @property
    def num_prefix_queried_tokens(self) -> int:
        return sum(r.num_prefix_queried_tokens for r in self.records)

    def as_dict(self) -> dict[str, Any]:
        t = self.timing
        latency = [t.finish_time_s[r] - t.arrival_time_s[r] for r in t.finish_time_s]
        queue = list(self.queue_iterations.values())
        return {
            "label": self.label,
            "config": dataclasses.asdict(self.config),
            "num_replayed": self.num_replayed,
            "num_refused": self.num_refused,
            "num_skipped": self.num_skipped,
            "num_iterations": t.num_iterations,
            "token_slots": t.token_slots,
            "occupancy": t.occupancy,
            "idle_fraction_by_reason": t.idle_fraction_by_reason,
            "num_preemptions": t.num_preemptions,
            "num_computed_tokens": self.num_computed_tokens,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "recompute_waste": self.num_recomputed_tokens / self.num_computed_tokens if self.num_computed_tokens else 0.0,
            "prefix_hit_rate": self.num_prefix_hit_tokens / self.num_prefix_queried_tokens if self.num_prefix_queried_tokens else 0.0,
            "queue_iterations": _stats(queue),
            "latency_iterations": _stats(latency),
            "makespan_iterations": t.makespan_s,
        }  # fmt: skip


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return {"mean": sum(ordered) / len(ordered), "p50": q(0.5), "p99": q(0.99), "max": ordered[-1]}


class _FakeModel:
    """Samples FILLER until a request has one token left of its recorded length, then END_OF_SEQUENCE."""

    def __init__(self, requests: dict[str, Request], lengths: dict[str, int]) -> None:
        self.requests, self.lengths = requests, lengths

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, SampledToken] = {}
        for row in out.rows:
            if not row.sample:
                continue
            request = self.requests[row.request_id]
            last = request.num_output_tokens + 1 >= self.lengths[row.request_id]
            sampled[row.request_id] = SampledToken(END_OF_SEQUENCE if last else FILLER)
        return ModelRunnerOutput(sampled=sampled)


def replay_unit(traffic: Traffic, config: ReplayConfig, label: str = "recorded") -> ReplayResult:
    """Every replayable request of ``traffic`` through the real scheduler under ``config``, on the unit clock."""
    run = _UnitReplay(traffic, config)
    ids = [
        r.request_id
        for r in traffic.requests
        if r.request_id in run.recorded and r.request_id not in run.refused
    ]
    timing = time_continuous_run(
        run.iterate,
        run.scheduler.has_unfinished,
        request_ids=ids,
        max_num_seqs=config.max_num_seqs,
        clock=run.clock,
        arrival_time_s={rid: run.recorded[rid].arrival_iteration for rid in ids},
        admit=run.admit,
    )
    run.kv.pool.check_integrity()
    queue = {
        rid: r.first_scheduled_time_s - run.admitted_at[rid]
        for rid, r in run.requests.items()
        if r.first_scheduled_time_s is not None
    }
    return ReplayResult(
        label=label,
        config=config,
        timing=timing,
        records=run.records,
        queue_iterations=queue,
        num_replayed=len(run.requests),
        num_refused=len(run.refused),
        num_skipped=len(traffic.requests) - len(run.recorded),
        num_computed_tokens=run.num_computed,
    )


class _UnitReplay:
    """The real scheduler and KV manager under ``config``, a model that replays the recorded lengths, the unit
    clock, and what the run records."""

    def __init__(self, traffic: Traffic, config: ReplayConfig) -> None:
        self.block_size = traffic.block_size
        self.kv = KVCacheManager(
            CacheConfig(block_size=config.block_size, num_blocks=config.num_kv_blocks),
            config.reserve,  # type: ignore[arg-type]
            enable_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                reserve=config.reserve,  # type: ignore[arg-type]
            ),
            self.kv,
            config.block_size,
        )
        self.recorded = {r.request_id: r for r in traffic.requests if r.num_output_tokens > 0}
        # what could never run under this configuration is refused at intake, as the engine would (a 400)
        self.refused = {
            rid
            for rid, rec in self.recorded.items()
            if (probe := _request(rec, config.block_size)).max_num_tokens > config.max_model_len
            or self.kv.max_blocks(probe) > self.kv.num_blocks
        }
        self.requests: dict[str, Request] = {}
        self.model = _FakeModel(self.requests, {rid: r.num_output_tokens for rid, r in self.recorded.items()})
        self.clock = UnitClock()
        self.records: list[StepRecord] = []
        self.admitted_at: dict[str, float] = {}
        self.num_computed = 0

    def admit(self, request_id: str) -> None:
        request = _request(self.recorded[request_id], self.block_size)
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        self.admitted_at[request_id] = self.clock.now()

    def iterate(self) -> IterationOutcome:
        now = self.clock.now()
        out = self.scheduler.schedule(now_s=now)
        before = {row.request_id: self.requests[row.request_id].num_output_tokens for row in out.rows}
        touched = self.scheduler.update_from_output(out, self.model.execute(out), now)
        self.records.append(out.record)
        self.num_computed += sum(len(row.token_ids) for row in out.rows)
        new_tokens = {
            r.request_id: r.output_token_ids[before.get(r.request_id, r.num_output_tokens) :]
            for r in touched
            if r.num_output_tokens > before.get(r.request_id, r.num_output_tokens)
        }
        return IterationOutcome(
            batch_size=out.record.batch_size,
            new_tokens=new_tokens,
            finished_ids=[r.request_id for r in touched if r.is_finished],
            preempted_ids=list(out.record.preempted_ids),
            idle_rows={reason.value: n for reason, n in out.record.idle_rows.items()},
        )


def _request(rec: TrafficRequest, block_size: int) -> Request:
    params = SamplingParams(max_tokens=max(rec.max_tokens, rec.num_output_tokens), temperature=0.0)
    return Request(
        request_id=rec.request_id,
        prompt_token_ids=synthetic_prompt(rec, block_size),
        sampling_params=params,
        eos_token_ids=frozenset({END_OF_SEQUENCE}),
    )


# --- the table ---------------------------------------------------------------------------------------------


def format_replay_table(results: Sequence[ReplayResult], traffic: Traffic) -> str:
    dicts = [r.as_dict() for r in results]
    first = results[0]
    reasons = sorted({k for d in dicts for k, v in d["idle_fraction_by_reason"].items() if v})
    rows: list[tuple[str, list[str]]] = [
        ("num_kv_blocks", [str(r.config.num_kv_blocks) for r in results]),
        ("max_num_seqs", [str(r.config.max_num_seqs) for r in results]),
        ("max_num_batched_tokens", [str(r.config.max_num_batched_tokens) for r in results]),
        ("reserve", [r.config.reserve for r in results]),
        ("prefix caching", ["on" if r.config.enable_prefix_caching else "off" for r in results]),
        ("requests replayed", [str(d["num_replayed"]) for d in dicts]),
        ("refused (never fit)", [str(d["num_refused"]) for d in dicts]),
        ("iterations", [str(d["num_iterations"]) for d in dicts]),
        ("token-slots", [str(d["token_slots"]) for d in dicts]),
        ("occupancy", [f"{d['occupancy']:.3f}" for d in dicts]),
        *((f"idle: {reason}", [f"{d['idle_fraction_by_reason'].get(reason, 0.0):.3f}" for d in dicts])
          for reason in reasons),
        ("tokens computed", [str(d["num_computed_tokens"]) for d in dicts]),
        ("preemptions", [str(d["num_preemptions"]) for d in dicts]),
        ("recomputed tokens", [str(d["num_recomputed_tokens"]) for d in dicts]),
        ("recompute waste", [f"{d['recompute_waste']:.3f}" for d in dicts]),
        ("prefix-cache hit rate", [f"{d['prefix_hit_rate']:.3f}" for d in dicts]),
        ("queue, mean / p99 (it.)", [f"{d['queue_iterations']['mean']:.1f} / {d['queue_iterations']['p99']:.0f}"
                                     for d in dicts]),
        ("latency, mean / p99 (it.)", [f"{d['latency_iterations']['mean']:.1f} / "
                                       f"{d['latency_iterations']['p99']:.0f}" for d in dicts]),
        ("makespan (it.)", [f"{d['makespan_iterations']:.0f}" for d in dicts]),
    ]  # fmt: skip
    heads = [r.label for r in results]
    widths = [max(len(h), *(len(cells[i]) for _, cells in rows)) for i, h in enumerate(heads)]
    label_w = max(len(name) for name, _ in rows)
    lines = [
        f"replay of {len(traffic.requests)} recorded requests over {traffic.duration_s:.0f} s"
        f" (model {traffic.model}, recorded {traffic.started_at}); unit clock: counts hold on any machine;"
        f" block size {first.config.block_size}"
        + (
            f"; {first.num_skipped} ended before their first token, not replayed" if first.num_skipped else ""
        ),
        " " * label_w + "  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)),
    ]
    for name, cells in rows:
        lines.append(
            name.ljust(label_w) + "  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
        )
    return "\n".join(lines)


# --- live --------------------------------------------------------------------------------------------------


async def replay_live(
    traffic: Traffic,
    base_url: str,
    api_key: str | None = None,
    speed: float = 1.0,
    timeout_s: float = 600.0,
    transport: Any = None,
) -> dict[str, Any]:
    """Each recorded request against a running server at its recorded arrival time (divided by ``speed``);
    ``transport``: httpx's (an in-process app, in tests)."""
    import httpx

    from tokenmill.bench.serve_bench import BenchConfig, _fetch_model, send_one, summarize

    cfg = BenchConfig(base_url=base_url, api_key=api_key, input_len=1, output_len=1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    replayable = [r for r in traffic.requests if r.num_output_tokens > 0]
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout_s, transport=transport
    ) as client:
        model = await _fetch_model(client)
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(rec: TrafficRequest) -> Any:
            await asyncio.sleep(max(0.0, t0 + rec.arrival_s / speed - loop.time()))
            prompt: Any = rec.prompt if rec.prompt is not None else synthetic_prompt(rec, traffic.block_size)
            result = await send_one(client, dataclasses.replace(cfg, output_len=rec.num_output_tokens), model,
                                    prompt, t0)  # fmt: skip
            result.prompt_len = rec.num_prompt_tokens
            return result

        results = await asyncio.gather(*(one(r) for r in replayable))
        duration = loop.time() - t0
    summary = summarize(results, duration, cfg)
    summary["num_skipped"] = len(traffic.requests) - len(replayable)
    return summary


# --- the command -------------------------------------------------------------------------------------------


def add_bench_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a recording from `tokenmill serve --record FILE`")
    parser.add_argument(
        "--num-kv-blocks", default=None, help="what-ifs: pool sizes, comma-separated (one column each)"
    )
    parser.add_argument("--max-num-seqs", default=None, help="what-ifs: batch widths, comma-separated")
    parser.add_argument(
        "--max-num-batched-tokens", default=None, help="what-ifs: token budgets, comma-separated"
    )
    parser.add_argument(
        "--reserve", default=None, choices=["none", "worst_case"], help="what-if: admission policy"
    )
    parser.add_argument("--no-enable-prefix-caching", action="store_true", help="what-if: prefix caching off")
    parser.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="a what-if changing several settings at once, e.g. num_kv_blocks=64,max_num_seqs=16",
    )
    parser.add_argument(
        "--live",
        metavar="URL",
        default=None,
        help="replay against this running server at the recorded arrival times instead",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="--live: arrivals this many times faster")
    parser.add_argument("--api-key", default=None, help="--live: the server's API key")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")  # fmt: skip


def what_ifs_from_args(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """One (label, changes) per what-if the flags ask for, in the order given."""
    out: list[tuple[str, dict[str, Any]]] = []
    for flag in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is None:
            continue
        for part in str(value).split(","):
            try:
                n = int(part)
            except ValueError:
                raise ValueError(f"--{flag.replace('_', '-')} takes integers, got {part!r}") from None
            out.append((f"{flag}={n}", {flag: n}))
    if args.reserve is not None:
        out.append((f"reserve={args.reserve}", {"reserve": args.reserve}))
    if args.no_enable_prefix_caching:
        out.append(("no prefix caching", {"enable_prefix_caching": False}))
    for text in args.what_if:
        out.append((text, parse_what_if(text)))
    return out


def run_bench_replay(args: argparse.Namespace) -> int:
    traffic = read_traffic(args.file)
    if not traffic.requests:
        raise ValueError(f"{args.file}: no requests recorded")
    if args.live:
        summary = asyncio.run(replay_live(traffic, args.live, args.api_key, args.speed))
        from tokenmill.bench.serve_bench import format_report

        print(format_report(summary))
        _write_json(args.json, summary)
        return 0
    base = ReplayConfig.of(traffic)
    results = [replay_unit(traffic, base, "recorded")]
    for label, changes in what_ifs_from_args(args):
        results.append(replay_unit(traffic, base.with_changes(changes), label))
    print(format_replay_table(results, traffic))
    _write_json(args.json, [r.as_dict() for r in results])
    return 0


def _write_json(path: str | None, body: Any) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=2)
        sys.stdout.flush()
        print(f"wrote {path}", file=sys.stderr)
