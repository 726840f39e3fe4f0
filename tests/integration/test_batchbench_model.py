"""batchbench on the real engine over the embedded model: the seed's counts exactly, the harness collecting exactly
what Engine emits, the refusal, the Week-9 reserve comparison, the CLI and the PNG. Times are printed, never
asserted (a unit clock's "times" are iteration counts, and those are asserted)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from tokenmill.bench.batching_cli import format_batching_report, format_reserve_table, main
from tokenmill.bench.continuous import (
    build_continuous_run,
    compare_model_batching,
    compare_reserve,
    default_reserve_pool,
    time_engine_run,
)
from tokenmill.bench.plot import plot_batching
from tokenmill.bench.static import greedy_params, time_batched_decode
from tokenmill.bench.timing import UnitClock, WallClock, compare_batching
from tokenmill.bench.workload import Workload, WorkloadRequest, resolve_workload, seed_workload
from tokenmill.config import EngineConfig


def table_rows(out: str) -> dict[str, list[str]]:
    """A printed table's rows: label -> cells (columns are separated by two spaces or more)."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 3:
            rows[cells[0]] = cells[1:]
    return rows


def seed_config(**overrides) -> EngineConfig:
    return EngineConfig(**{"max_num_seqs": 8, "num_kv_blocks": 64, "device": "cpu", **overrides})


@pytest.fixture(scope="module")
def seed_unit(embedded_loaded):
    """The seed workload both ways on the real model, under a unit clock."""
    return compare_model_batching(seed_workload(), seed_config(), clock=UnitClock(), loaded=embedded_loaded)


@pytest.mark.slow
def test_seed_workload_counts_are_the_seeds(seed_unit) -> None:
    s, c, counts = seed_unit.static, seed_unit.continuous, seed_unit.comparison.counts
    # Static: 8 rows x 32 forwards (1 prefill + 31 decode steps).
    assert s.token_slots == 256
    assert s.collected_tokens == 60
    assert s.useful_tokens == 52  # 7 x 3 + 31
    assert s.decode_token_slots == 248
    assert f"{s.waste_fraction:.1%}" == "79.0%"
    # Scheduled: a row is in the batch only while it wants a token.
    assert c.token_slots == 60
    assert c.collected_tokens == 60
    assert f"{c.waste_fraction:.1%}" == "0.0%"
    assert c.batch_sizes == (8, 8, 8, 8) + (1,) * 28
    assert f"{counts.work_ratio:.2f}" == "4.27"
    assert counts.waste_removed == 1.0
    assert f"{counts.occupancy:.3f}" == "0.234"
    assert counts.idle_fraction_by_reason == {"queue_empty": pytest.approx(196 / 256)}  # queue drained
    assert counts.num_preemptions == 0


@pytest.mark.slow
def test_under_a_unit_clock_the_makespan_is_the_schedule(seed_unit) -> None:
    t = seed_unit.comparison.times
    assert t.unit == "iterations"
    assert (t.static_makespan_s, t.continuous_makespan_s) == (32.0, 32.0)
    assert t.makespan_speedup == 1.0  # no reaping iteration: the seed's 0.97 was 32 / 33
    assert t.first_answer_speedup == 8.0  # 32 / 4
    assert t.mean_latency_speedup == pytest.approx(32 / ((7 * 4 + 32) / 8))


@pytest.mark.slow
def test_harness_collects_exactly_what_the_engine_emits(seed_unit, make_engine) -> None:
    c = seed_unit.continuous
    for r in seed_unit.requests:
        assert list(c.tokens[r.request_id]) == seed_unit.outputs[r.request_id].outputs[0].token_ids
    # ... and what a fresh Engine.generate emits for the same prompts.
    engine = make_engine(max_num_seqs=8, num_kv_blocks=64)
    outs = engine.generate(
        [list(r.prompt_token_ids) for r in seed_unit.requests],
        [greedy_params(r.max_tokens) for r in seed_unit.requests],
    )
    assert [list(c.tokens[r.request_id]) for r in seed_unit.requests] == [
        o.outputs[0].token_ids for o in outs
    ]
    # The engine's own counters agree with the harness.
    stats = seed_unit.engine_stats
    assert stats["num_iterations"] == c.num_iterations == 32
    assert stats["num_token_slots"] == c.token_slots
    assert stats["num_collected_tokens"] == c.collected_tokens
    assert stats["occupancy"] == pytest.approx(c.occupancy)
    assert stats["idle_rows_by_reason"]["queue_empty"] == c.idle_rows_by_reason["queue_empty"]


@pytest.mark.slow
def test_static_batch_collects_the_same_text(seed_unit) -> None:
    for rid in seed_unit.static.request_ids:
        assert seed_unit.static.tokens[rid] == seed_unit.continuous.tokens[rid]


@pytest.mark.slow
def test_a_pairing_with_one_token_different_is_refused(seed_unit) -> None:
    c = seed_unit.continuous
    tokens = list(c.tokens["r2"])
    tokens[1] += 1
    changed = replace(c, tokens=c.tokens | {"r2": tuple(tokens)})
    with pytest.raises(ValueError, match=r"request 'r2'.*output position 1"):
        compare_batching(seed_unit.static, changed)


def test_wall_clock_run_prints_times(embedded_loaded, capsys) -> None:
    workload = Workload(
        (
            WorkloadRequest(max_tokens=2, prompt="The capital of France is"),
            WorkloadRequest(max_tokens=6, prompt_len=3),
        )
    )
    result = compare_model_batching(
        workload, seed_config(max_num_seqs=2), clock=WallClock(), loaded=embedded_loaded
    )
    assert result.comparison.counts.static_token_slots == 12  # 2 rows x 6 forwards
    assert result.comparison.counts.continuous_token_slots == 8
    assert result.comparison.times.unit == "s"
    report = format_batching_report(result.static, result.continuous, result.comparison)
    with capsys.disabled():
        print("\n" + report)
    assert "seconds on this machine" in report


def test_arrivals_are_admitted_on_the_unit_clock(embedded_loaded) -> None:
    workload = Workload(
        (
            WorkloadRequest(max_tokens=3, prompt_len=4),
            WorkloadRequest(max_tokens=3, prompt_len=4, arrival_time_s=5),
        )
    )
    result = compare_model_batching(
        workload, seed_config(max_num_seqs=2), clock=UnitClock(), loaded=embedded_loaded
    )
    c = result.continuous
    assert c.batch_sizes == (1, 1, 1, 1, 1, 1)  # r0 alone; nothing to do until r1 arrives at 5; r1 alone
    assert c.iteration_end_s == (1.0, 2.0, 3.0, 6.0, 7.0, 8.0)
    assert c.latency_s == {"r0": 3.0, "r1": 3.0}
    assert result.static.start_s == 5.0  # a static batch waits for its last row
    assert result.static.makespan_s == 8.0
    assert result.static.latency_s == {"r0": 8.0, "r1": 3.0}


def test_build_continuous_run_refuses_a_busy_engine(make_engine, embedded_loaded) -> None:
    engine = make_engine(max_num_seqs=2)
    engine.add_request([1000, 1001], greedy_params(2))
    requests = resolve_workload(seed_workload(), engine.tokenizer.encode, engine.tokenizer.vocab_size)
    with pytest.raises(ValueError, match="unfinished"):
        build_continuous_run(engine, requests)


def test_static_and_engine_agree_one_side_at_a_time(embedded_loaded, make_engine) -> None:
    engine = make_engine(max_num_seqs=3, clock=UnitClock().now)
    requests = resolve_workload(
        Workload(tuple(WorkloadRequest(max_tokens=m, prompt_len=p) for m, p in [(5, 2), (1, 7), (3, 3)])),
        engine.tokenizer.encode,
        engine.tokenizer.vocab_size,
    )
    static = time_batched_decode(embedded_loaded, requests, clock=UnitClock())
    continuous = time_engine_run(engine, requests, UnitClock())
    cmp = compare_batching(static, continuous)  # prompts of different lengths: a packed prefill
    assert cmp.counts.static_token_slots == 15  # 3 rows x 5 forwards
    assert cmp.counts.continuous_token_slots == 9  # 5 + 1 + 3
    assert continuous.batch_sizes == (3, 2, 2, 1, 1)


# --- Week 9: reserve=worst_case vs none on a pool for four worst-case reservations ----------------------
@pytest.mark.slow
def test_reserve_comparison_on_the_seed_pool(embedded_loaded, capsys) -> None:
    workload = seed_workload()
    tok = embedded_loaded.tokenizer
    assert default_reserve_pool(resolve_workload(workload, tok.encode, tok.vocab_size), 16) == 4
    cmp = compare_reserve(
        workload, seed_config(num_kv_blocks=None), clock_factory=UnitClock, loaded=embedded_loaded
    )
    worst, none = cmp.timings["worst_case"], cmp.timings["none"]
    with capsys.disabled():
        print("\n" + format_reserve_table(cmp.timings, cmp.num_kv_blocks, cmp.block_size, workload.name))
    # worst_case: r0-r3 (1 block each) fill the pool; r4-r6 follow; the straggler books its worst case (3 blocks)
    # and waits until they are gone: 4 + 4 + 32 iterations. none: the straggler starts with 1 block beside r4-r6.
    assert worst.num_iterations == 40
    assert none.num_iterations == 36
    assert f"{worst.occupancy:.3f}" == "0.188"
    assert f"{none.occupancy:.3f}" == "0.208"
    assert worst.token_slots == none.token_slots == 60
    assert worst.num_preemptions == none.num_preemptions == 0
    assert (
        worst.idle_rows_by_reason.get("kv_pool_full", 0) + worst.idle_rows_by_reason.get("kv_reserved", 0) > 0
    )


# --- the CLI and the picture ---------------------------------------------------------------------------
@pytest.fixture
def cli_uses_loaded_model(monkeypatch, embedded_loaded):
    import tokenmill.bench.continuous as continuous

    monkeypatch.setattr(continuous, "load_for_bench", lambda config: embedded_loaded)


@pytest.mark.slow
def test_cli_prints_the_seed_table(cli_uses_loaded_model, seed_unit, monkeypatch, capsys) -> None:
    # The run itself is the module's seed_unit (pinned above); this checks what the CLI runs and prints.
    import tokenmill.bench.continuous as continuous

    calls = []

    def fake_compare(workload, config, *, clock, loaded):
        calls.append((workload, config, clock))
        return seed_unit

    monkeypatch.setattr(continuous, "compare_model_batching", fake_compare)
    assert main(["--unit-clock", "--device", "cpu"]) == 0
    ((workload, config, clock),) = calls
    assert workload == seed_workload()
    assert config.max_num_seqs == 8  # the static batch's width
    assert isinstance(clock, UnitClock)
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    rows = table_rows(out)
    assert rows["token-slots computed"] == ["256", "60"]
    assert rows["tokens collected"] == ["60", "60"]
    assert rows["waste fraction"] == ["79.0%", "0.0%"]
    assert rows["makespan"] == ["32 it", "32 it"]
    assert rows["first answer"] == ["32 it", "4 it"]
    assert out.index("counts (properties of the schedule") < out.index("times (counted in iterations")
    assert "work ratio        4.27x" in out
    assert "occupancy         0.234 of 8 rows; idle: queue drained 0.766" in out


def test_cli_json_and_plot_from_a_workload_file(cli_uses_loaded_model, capsys, tmp_path) -> None:
    wl = tmp_path / "w.jsonl"
    wl.write_text(
        '{"prompt": "Hello there", "max_tokens": 2}\n{"prompt_len": 4, "max_tokens": 5, "id": "long"}\n'
    )
    png = tmp_path / "cs.png"
    assert main(["--workload", str(wl), "--unit-clock", "--json", "--plot", str(png), "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["comparison"]) == {"counts", "times"}
    assert result["comparison"]["counts"]["static_token_slots"] == 10
    assert result["comparison"]["counts"]["continuous_token_slots"] == 7
    assert result["comparison"]["times"]["unit"] == "iterations"
    assert set(result["continuous"]["requests"]) == {"r0", "long"}
    assert png.exists() and 20_000 < png.stat().st_size < 2_000_000


def test_cli_compare_reserve(cli_uses_loaded_model, capsys, tmp_path) -> None:
    # Three requests wanting 4 tokens (1 block of 16 each) and one wanting 20 (worst case 2 blocks): the default
    # pool is 4 blocks. worst_case: the fourth waits for its 2 reserved blocks until the others are done (4 + 20
    # iterations); none: it starts beside them with 1 block and grows after they are gone (20 iterations).
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt_len": 5, "max_tokens": 4}\n' * 3 + '{"prompt_len": 5, "max_tokens": 20}\n')
    assert main(["--workload", str(wl), "--compare-reserve", "--unit-clock", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert "KV pool: 4 blocks of 16 tokens, max_num_seqs 4" in out
    rows = table_rows(out)
    assert rows["iterations"] == ["24", "20"]
    assert rows["preemptions"] == ["0", "0"]
    assert rows["tokens collected"] == ["32", "32"]
    assert rows["occupancy"] == [f"{32 / (4 * 24):.3f}", f"{32 / (4 * 20):.3f}"]


def test_cli_rejects_a_bad_workload_file(tmp_path, capsys) -> None:
    wl = tmp_path / "bad.jsonl"
    wl.write_text('{"prompt_len": 4}\n')
    assert main(["--workload", str(wl)]) == 2
    assert "bad.jsonl:1: max_tokens is required" in capsys.readouterr().err


@pytest.mark.slow
def test_png_shows_both_runs(seed_unit, tmp_path) -> None:
    import matplotlib.image

    path = plot_batching(seed_unit.static, seed_unit.continuous, tmp_path / "continuous-vs-static.png")
    assert path.exists()
    assert 40_000 < path.stat().st_size < 2_000_000
    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert width == 1300 and 700 < height < 1100
