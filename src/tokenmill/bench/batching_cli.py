"""`tokenmill bench batching`: static vs continuous batching on one clock, the seed's table.

By default it runs the seed's workload (8 requests, 5-token prompts, seven wanting 4 tokens and one wanting 32)
on the embedded model, static first and then through the engine, and prints the table, then the counts (true
on any machine) and the times (true on this one) as two separate blocks.

    tokenmill bench batching                          # the seed's table, wall clock
    tokenmill bench batching --unit-clock             # every iteration costs 1: the schedule, in iterations
    tokenmill bench batching --workload w.jsonl       # {"prompt" | "prompt_len", "max_tokens", "arrival_time_s"}
    tokenmill bench batching --json --plot continuous-vs-static.png
    tokenmill bench batching --compare-reserve        # reserve=worst_case vs none on one small pool

``--compare-reserve`` runs only the engine, twice, over one pool of ``--num-kv-blocks`` blocks (default: room
for four worst-case reservations of a typical request, 4 blocks of 16 on the seed workload), once with
``reserve=worst_case`` and once with ``reserve=none``, and prints iterations, occupancy and preemptions side
by side. Also runnable as ``python -m tokenmill.bench.batching_cli``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from tokenmill.bench.timing import BatchingComparison, BatchTiming, ContinuousTiming
from tokenmill.engine_args import add_engine_arguments, engine_config_from_args

REASON_NAMES = {
    "queue_empty": "queue drained",
    "kv_pool_full": "KV pool full",
    "kv_reserved": "held by worst-case reservations",
    "token_budget": "token budget",
    "preempted": "admission paused by a preemption",
    "max_num_seqs": "max_num_seqs",
    "unattributed": "no reason given",
}


def add_bench_batching_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default=None,
        metavar="FILE",
        help="JSON lines: prompt or prompt_len, max_tokens, optional arrival_time_s and id (default: the seed's)",
    )
    parser.add_argument(
        "--unit-clock", action="store_true", help="every iteration costs 1: times become iterations"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the machine-readable result instead of tables"
    )
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="draw both runs (continuous-vs-static.png)"
    )
    parser.add_argument(
        "--compare-reserve",
        action="store_true",
        help="run the engine twice on one pool, reserve=worst_case vs none (pool: --num-kv-blocks, default 4x a "
        "typical request's worst case)",
    )
    # the engine's own flags (engine_args), with this command's defaults: --num-kv-blocks every request's worst
    # case at once (with --compare-reserve: room for four worst-case reservations of a typical request),
    # --max-num-seqs the workload's size; --seed is the engine's seed, as --engine-seed
    add_engine_arguments(parser)
    parser.set_defaults(max_num_seqs=None, max_num_batched_tokens=2048)
    parser.add_argument("--seed", dest="engine_seed", type=int, help=argparse.SUPPRESS)


def run_bench_batching(args: argparse.Namespace) -> int:
    from tokenmill.bench.continuous import compare_model_batching, compare_reserve, load_for_bench
    from tokenmill.bench.timing import UnitClock, WallClock
    from tokenmill.bench.workload import load_workload, seed_workload

    try:
        workload = load_workload(args.workload) if args.workload else seed_workload()
        args.max_num_seqs = args.max_num_seqs or len(workload)
        config = engine_config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)
    try:
        loaded = load_for_bench(config)
    except (ValueError, OSError) as e:
        print(f"error: cannot load the model: {e}", file=sys.stderr)
        return 2
    clock_factory = UnitClock if args.unit_clock else WallClock

    if args.compare_reserve:
        try:
            cmp = compare_reserve(workload, config, clock_factory=clock_factory, loaded=loaded)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps({"workload": workload.name, **cmp.to_dict()}, indent=2))
        else:
            print(format_reserve_table(cmp.timings, cmp.num_kv_blocks, cmp.block_size, workload.name))
        if args.plot:
            print(
                "note: --plot draws static vs continuous; nothing drawn with --compare-reserve",
                file=sys.stderr,
            )
        return 0

    try:
        result = compare_model_batching(workload, config, clock=clock_factory(), loaded=loaded)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print_batching(result, workload.name, config, args)
    if args.plot:
        from tokenmill.bench.plot import plot_batching

        path = plot_batching(result.static, result.continuous, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _print_batching(result: Any, workload_name: str, config: Any, args: argparse.Namespace) -> None:
    """The static-vs-continuous result: JSON, or the header, the report and the prefix-cache line."""
    header = (
        f"workload: {workload_name}\nmodel: {result.model_name} on {result.device} {result.dtype};"
        f" max_num_seqs {config.max_num_seqs}, block_size {config.block_size},"
        f" num_kv_blocks {result.num_kv_blocks}, reserve={config.reserve};"
        f" clock: {'unit (every iteration costs 1)' if args.unit_clock else 'wall'}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "workload": workload_name,
                    "model": result.model_name,
                    "device": result.device,
                    "dtype": result.dtype,
                    "config": {
                        "max_num_seqs": config.max_num_seqs,
                        "block_size": config.block_size,
                        "num_kv_blocks": result.num_kv_blocks,
                        "reserve": config.reserve,
                    },
                    "comparison": result.comparison.to_dict(),
                    "static": result.static.to_dict(),
                    "continuous": result.continuous.to_dict(),
                    "engine_stats": result.engine_stats,
                },
                indent=2,
            )
        )
    else:
        print(header)
        print()
        print(format_batching_report(result.static, result.continuous, result.comparison))
        stats = result.engine_stats or {}
        if result.roofline_limits is not None:
            print(format_roofline(stats, result.roofline_limits))
        if stats.get("num_prefix_hit_tokens"):
            queried, hit = stats["num_prefix_queried_tokens"], stats["num_prefix_hit_tokens"]
            print(
                f"prefix cache: {hit} of {queried} tokens looked up were cached ({hit / queried:.1%}), "
                f"{stats.get('num_prefix_evicted_blocks', 0)} blocks evicted"
            )
        if stats.get("num_spec_drafts"):
            print(
                f"speculative decoding: {stats['num_spec_drafts']} verifications, {stats['num_spec_draft_tokens']} "
                f"tokens proposed, {stats['num_spec_accepted_tokens']} accepted (acceptance rate "
                f"{stats['spec_acceptance_rate']:.1%}, mean acceptance length {stats['spec_mean_acceptance_length']:.2f}"
                f" tokens per verification row), waste {stats['spec_waste_fraction']:.1%} of decode positions "
                f"(rejected proposals); accepted per position {stats['spec_accepted_per_pos']}"
            )


def format_roofline(stats: dict[str, Any], limits: str) -> str:
    """The engine's steps against the machine's limit, by kind (``tokenmill.measure.roofline``)."""
    fractions, counts = stats.get("roofline_fraction_by_kind") or {}, stats.get("num_roofline_steps") or {}
    parts = [f"{kind} {fractions[kind]:.2f} ({counts.get(kind, 0)} steps)" for kind in sorted(fractions)]
    return f"roofline (the engine's steps' least possible time / their wall time, limits {limits}): " + (
        ", ".join(parts) or "no steps"
    )


# --- tables ------------------------------------------------------------------------------------------
def _time(value: float, unit: str) -> str:
    return f"{value:.4g} it" if unit == "iterations" else f"{value:.2f}s"


def _rate(value: float, unit: str) -> str:
    return f"{value:.2f} tok/it" if unit == "iterations" else f"{value:.2f} tok/s"


def _table(rows: Sequence[tuple[str, str, str]], head: tuple[str, str, str]) -> str:
    w0 = max(len(r[0]) for r in [head, *rows])
    w1 = max(len(r[1]) for r in [head, *rows])
    w2 = max(len(r[2]) for r in [head, *rows])
    return "\n".join(f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}" for a, b, c in [head, *rows])


def run_lengths(values: Sequence[int]) -> str:
    """``[8, 8, 8, 8, 1, 1]`` -> ``"8x4, 1x2"``."""
    parts: list[list[int]] = []
    for v in values:
        if parts and parts[-1][0] == v:
            parts[-1][1] += 1
        else:
            parts.append([v, 1])
    return ", ".join(f"{v}x{n}" for v, n in parts)


def format_idle(timing: ContinuousTiming) -> str:
    shares = timing.idle_fraction_by_reason
    if not shares:
        return "none"
    return ", ".join(
        f"{REASON_NAMES.get(k, k)} {v:.3f}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
    )


def format_batching_report(static: BatchTiming, cont: ContinuousTiming, cmp: BatchingComparison) -> str:
    """The seed's table, then the counts and the times as two separate blocks."""
    unit = cmp.times.unit
    t = cmp.times
    table = _table(
        [
            ("token-slots computed", str(static.token_slots), str(cont.token_slots)),
            ("tokens collected", str(static.collected_tokens), str(cont.collected_tokens)),
            ("waste fraction", f"{static.waste_fraction:.1%}", f"{cont.waste_fraction:.1%}"),
            ("makespan", _time(t.static_makespan_s, unit), _time(t.continuous_makespan_s, unit)),
            ("first answer", _time(t.static_first_answer_s, unit), _time(t.continuous_first_answer_s, unit)),
            ("mean latency", _time(t.static_mean_latency_s, unit), _time(t.continuous_mean_latency_s, unit)),
            (
                "goodput (end to end)",
                _rate(t.static_goodput_tps, unit),
                _rate(t.continuous_goodput_tps, unit),
            ),
        ],
        ("", "static", "scheduled"),
    )
    c = cmp.counts
    counts = [
        "counts (properties of the schedule: the same on any machine)",
        f"  work ratio        {c.work_ratio:.2f}x  static token-slots / scheduled token-slots, identical text",
        f"  waste removed     {c.waste_removed:.1%} of the static waste"
        f" ({c.static_waste_fraction:.1%} -> {c.continuous_waste_fraction:.1%})",
        f"  static            {c.static_token_slots} token-slots = {c.static_width} rows x {c.static_iterations}"
        f" forwards (1 prefill + {c.static_iterations - 1} decode steps); {c.static_useful_tokens} useful decode"
        f" tokens over {c.static_decode_token_slots} decode slots",
        f"  scheduled         {c.continuous_token_slots} token-slots over {c.continuous_iterations} iterations,"
        f" batch sizes {run_lengths(cont.batch_sizes)}",
        f"  tokens            {c.collected_tokens} collected by each (static: {c.static_useful_tokens} useful"
        f" + {c.static_width} from the prefill)",
        f"  occupancy         {c.occupancy:.3f} of {c.continuous_width} rows; idle: {format_idle(cont)}",
        "                    (shares of all row-iterations: occupancy + idle = 1)",
        f"  preemptions       {c.num_preemptions}",
    ]
    where = (
        "counted in iterations: every forward costs 1" if unit == "iterations" else "seconds on this machine"
    )
    times = [
        f"times ({where}; > 1 means continuous did better)",
        f"  makespan          {t.makespan_speedup:.2f}x",
        f"  mean latency      {t.mean_latency_speedup:.2f}x",
        f"  first answer      {t.first_answer_speedup:.2f}x",
        f"  goodput           {t.goodput_speedup:.2f}x",
    ]
    if unit == "iterations":
        times.append(
            "  (continuous batching is not a makespan optimisation: it frees rows, it does not fill them)"
        )
    return "\n".join([table, "", *counts, "", *times])


def format_reserve_table(
    timings: dict[str, ContinuousTiming], num_kv_blocks: int, block_size: int, name: str
) -> str:
    a, b = timings["worst_case"], timings["none"]
    unit = a.clock_unit
    reasons = sorted(set(a.idle_fraction_by_reason) | set(b.idle_fraction_by_reason))
    rows = [
        ("iterations", str(a.num_iterations), str(b.num_iterations)),
        ("occupancy", f"{a.occupancy:.3f}", f"{b.occupancy:.3f}"),
        ("preemptions", str(a.num_preemptions), str(b.num_preemptions)),
        ("token-slots computed", str(a.token_slots), str(b.token_slots)),
        ("tokens collected", str(a.collected_tokens), str(b.collected_tokens)),
        ("waste fraction", f"{a.waste_fraction:.1%}", f"{b.waste_fraction:.1%}"),
        *[
            (
                f"idle: {REASON_NAMES.get(r, r)}",
                f"{a.idle_fraction_by_reason.get(r, 0.0):.3f}",
                f"{b.idle_fraction_by_reason.get(r, 0.0):.3f}",
            )
            for r in reasons
        ],
        ("batch sizes", run_lengths(a.batch_sizes), run_lengths(b.batch_sizes)),
        ("makespan", _time(a.makespan_s, unit), _time(b.makespan_s, unit)),
        ("first answer", _time(a.first_answer_s, unit), _time(b.first_answer_s, unit)),
        ("mean latency", _time(a.mean_latency_s, unit), _time(b.mean_latency_s, unit)),
    ]
    head = (
        f"workload: {name}\nKV pool: {num_kv_blocks} blocks of {block_size} tokens, max_num_seqs {a.max_num_seqs};"
        f" same text both ways\n"
    )
    return head + _table(rows, ("", "reserve=worst_case", "reserve=none"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill bench batching", description=__doc__.split("\n\n")[0])
    add_bench_batching_arguments(parser)
    return run_bench_batching(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
