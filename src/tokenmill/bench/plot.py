"""The seed's continuous-vs-static.png: one row per request, time across, both runs on one clock.

Top: the static batch, each row solid while it still wanted tokens and hatched from its last wanted token to the
straggler's end (computed, thrown away). Middle: the scheduled run, each row drawn only in the iterations that
gave it a token and ending when it finishes, preemptions marked. Bottom: every iteration's rows, computed and
idle by reason, so the occupancy can be read off. The headline counts are in the title; the times, which
describe this machine, in the subtitle. Uses matplotlib's Agg canvas directly: no global backend switch.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from tokenmill.bench.timing import BatchTiming, ContinuousTiming

WANTED = "#4c72b0"
WASTED = "#dddddd"
COMPUTED = "#55a868"
REASON_COLORS = {
    "queue_empty": "#8fbcd4",
    "kv_pool_full": "#dd8452",
    "kv_reserved": "#c44e52",
    "token_budget": "#8172b3",
    "preempted": "#937860",
    "max_num_seqs": "#ccb974",
    "unattributed": "#bbbbbb",
}
REASON_LABELS = {
    "queue_empty": "idle: queue drained",
    "kv_pool_full": "idle: KV pool full",
    "kv_reserved": "idle: held by worst-case reservations",
    "token_budget": "idle: token budget spent",
    "preempted": "idle: admission paused by a preemption",
    "max_num_seqs": "idle: max_num_seqs",
    "unattributed": "idle: no reason given",
}


def plot_batching(static: BatchTiming, continuous: ContinuousTiming, path: str | Path) -> Path:
    """Draw both runs and write a PNG to ``path``; returns the path."""
    path = Path(path)
    ids = list(static.request_ids)
    n = len(ids)
    fig = Figure(figsize=(13, 4.0 + 0.55 * n), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_s, ax_c, ax_i = fig.subplots(3, 1, sharex=True, height_ratios=[n, n, max(3.0, n * 0.6)])
    unit = "iterations" if static.clock_unit == "iterations" else "s"

    _draw_static(ax_s, static, ids)
    _draw_continuous(ax_c, continuous, ids)
    _draw_occupancy(ax_i, continuous)
    ax_i.set_xlabel("iterations (unit clock: every forward costs 1)" if unit == "iterations" else "time (s)")
    end = max(static.makespan_s, continuous.makespan_s)
    ax_i.set_xlim(0, end * 1.04 if end > 0 else 1.0)

    work_ratio = static.token_slots / continuous.token_slots if continuous.token_slots else float("nan")
    fig.suptitle(
        f"static {static.token_slots} token-slots vs scheduled {continuous.token_slots}"
        f" for {continuous.collected_tokens} tokens ({work_ratio:.2f}x the work)   |   waste"
        f" {static.waste_fraction:.1%} -> {continuous.waste_fraction:.1%}   |   occupancy {continuous.occupancy:.3f}"
        f"   |   preemptions {continuous.num_preemptions}\n"
        f"{'unit clock, in iterations' if unit == 'iterations' else 'times on this machine'}: first answer {_fmt(static.first_answer_s, unit)} -> "
        f"{_fmt(continuous.first_answer_s, unit)}, mean latency {_fmt(static.mean_latency_s, unit)} -> "
        f"{_fmt(continuous.mean_latency_s, unit)}, makespan {_fmt(static.makespan_s, unit)} -> "
        f"{_fmt(continuous.makespan_s, unit)}",
        fontsize=11,
    )
    fig.savefig(path)
    return path


def _fmt(value: float, unit: str) -> str:
    return f"{value:.4g} it" if unit == "iterations" else f"{value:.2f}s"


def _rows_axis(ax: Axes, ids: list[str], title: str) -> None:
    ax.set_yticks(range(len(ids)), ids)
    ax.set_ylim(len(ids) - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _draw_static(ax: Axes, static: BatchTiming, ids: list[str]) -> None:
    _rows_axis(
        ax,
        ids,
        f"static batch of {static.batch_size}: every row computed for {static.num_iterations} forwards"
        " (1 prefill + decode steps), handed back together at the straggler's end",
    )
    t0, end = static.start_s, static.makespan_s
    for y, rid in enumerate(ids):
        arrival = static.arrival_time_s[rid]
        if arrival < t0:
            ax.plot([arrival, t0], [y, y], color="#999999", lw=1, ls=":")
        done = static.row_done_s(rid)
        ax.barh(y, done - t0, left=t0, height=0.6, color=WANTED)
        if end > done:
            ax.barh(
                y, end - done, left=done, height=0.6, color=WASTED, hatch="///", edgecolor="#999999", lw=0
            )
    ax.axvline(end, color="black", lw=1)
    ax.legend(
        handles=[
            Patch(color=WANTED, label="computing tokens the row wanted"),
            Patch(facecolor=WASTED, hatch="///", edgecolor="#999999", label="computed, not wanted (waste)"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )


def _draw_continuous(ax: Axes, cont: ContinuousTiming, ids: list[str]) -> None:
    _rows_axis(
        ax,
        ids,
        f"scheduled (continuous batching, max_num_seqs={cont.max_num_seqs}): {cont.num_iterations} iterations,"
        " a row is in the batch only while it still wants a token",
    )
    active: dict[str, list[int]] = {rid: [] for rid in ids}
    for i, got in enumerate(cont.token_request_ids):
        for rid in got:
            active.setdefault(rid, []).append(i)
    for y, rid in enumerate(ids):
        iterations = active.get(rid, [])
        first_start = (
            cont.iteration_start_s(iterations[0]) if iterations else cont.finish_time_s.get(rid, 0.0)
        )
        arrival = cont.arrival_time_s[rid]
        if first_start > arrival:
            ax.plot([arrival, first_start], [y, y], color="#999999", lw=1, ls=":")
        for a, b in _runs(iterations):
            left = cont.iteration_start_s(a)
            ax.barh(y, cont.iteration_end_s[b] - left, left=left, height=0.6, color=COMPUTED)
        if rid in cont.finish_time_s:
            ax.plot([cont.finish_time_s[rid]], [y], marker="|", color="black", markersize=14)
    for i, preempted in enumerate(cont.preempted_ids):
        for rid in preempted:
            if rid in ids:
                ax.plot(
                    [cont.iteration_start_s(i)],  # preempted while scheduling, before the forward
                    [ids.index(rid)],
                    marker="x",
                    color="#c44e52",
                    markersize=9,
                    mew=2,
                )
    ax.legend(
        handles=[
            Patch(color=COMPUTED, label="in the batch (got a token)"),
            Line2D(
                [], [], marker="|", color="black", ls="", markersize=12, label="finished (last token sampled)"
            ),
            Line2D([], [], marker="x", color="#c44e52", ls="", mew=2, label="preempted (recompute)"),
            Line2D([], [], color="#999999", ls=":", label="waiting"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )


def _draw_occupancy(ax: Axes, cont: ContinuousTiming) -> None:
    width = cont.max_num_seqs
    lefts = [cont.iteration_start_s(i) for i in range(cont.num_iterations)]
    widths = list(cont.iteration_times_s)
    if widths and not any(widths):
        widths = [1.0] * len(widths)  # a clock that never moved: draw iterations side by side
        lefts = [float(i) for i in range(len(widths))]
    bottoms = [float(b) for b in cont.batch_sizes]
    ax.bar(lefts, bottoms, width=widths, align="edge", color=COMPUTED, lw=0)
    reasons = sorted(
        {r for per in cont.idle_rows for r in per},
        key=lambda r: list(REASON_COLORS).index(r) if r in REASON_COLORS else 99,
    )
    handles = [Patch(color=COMPUTED, label=f"rows computed (occupancy {cont.occupancy:.3f})")]
    for reason in reasons:
        heights = [float(per.get(reason, 0)) for per in cont.idle_rows]
        color = REASON_COLORS.get(reason, "#bbbbbb")
        ax.bar(lefts, heights, width=widths, bottom=bottoms, align="edge", color=color, lw=0)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
        share = cont.idle_fraction_by_reason.get(reason, 0.0)
        handles.append(Patch(color=color, label=f"{REASON_LABELS.get(reason, reason)} ({share:.3f})"))
    rest = [width - b for b in bottoms]
    if any(r > 0 for r in rest):
        ax.bar(
            lefts, rest, width=widths, bottom=bottoms, align="edge", color=REASON_COLORS["unattributed"], lw=0
        )
        handles.append(Patch(color=REASON_COLORS["unattributed"], label=REASON_LABELS["unattributed"]))
    ax.set_ylim(0, width)
    ax.set_ylabel("rows")
    ax.set_title(
        f"scheduled run, every iteration's {width} rows: computed or idle, by reason", loc="left", fontsize=10
    )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of iteration indices, as (first, last) pairs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs
