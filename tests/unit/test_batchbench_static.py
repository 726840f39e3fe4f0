"""batchbench, static side (Day 29) and the workload spec: a fake clock and scripted rows, hand-computed numbers."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import pytest

from tokenmill.bench.timing import BatchTiming, UnitClock, WallClock, time_static_run
from tokenmill.bench.workload import (
    Workload,
    WorkloadRequest,
    load_workload,
    parse_workload_lines,
    resolve_workload,
    seed_workload,
    synthetic_prompt,
)

SEED_MAX_TOKENS = {f"r{i}": 4 for i in range(7)} | {"r7": 32}


class FakeClock:
    """Time moves only when a scripted callable says so."""

    unit = "s"

    def __init__(self) -> None:
        self.t = 0.0
        self.num_iterations_done = 0

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt

    def iteration_done(self) -> None:
        self.num_iterations_done += 1

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


class ScriptedStaticBatch:
    """Row ``i`` samples token ``1000 * i + k`` at its k-th forward; a forward costs ``cost`` on the clock."""

    def __init__(
        self, max_tokens: Mapping[str, int], clock: FakeClock | None, prefill_cost: float, step_cost: float
    ):
        self.ids = list(max_tokens)
        self.clock = clock
        self.prefill_cost = prefill_cost
        self.step_cost = step_cost
        self.num_forwards = 0

    def _forward(self, cost: float) -> dict[str, int]:
        if self.clock is not None:
            self.clock.advance(cost)
        k = self.num_forwards
        self.num_forwards += 1
        return {rid: 1000 * i + k for i, rid in enumerate(self.ids)}

    def prefill(self) -> dict[str, int]:
        return self._forward(self.prefill_cost)

    def decode_step(self) -> dict[str, int]:
        return self._forward(self.step_cost)


def run_seed(clock: FakeClock | UnitClock, prefill_cost: float = 2.0, step_cost: float = 0.5) -> BatchTiming:
    batch = ScriptedStaticBatch(
        SEED_MAX_TOKENS, clock if isinstance(clock, FakeClock) else None, prefill_cost, step_cost
    )
    return time_static_run(batch.prefill, batch.decode_step, max_tokens=SEED_MAX_TOKENS, clock=clock)


# --- counts ----------------------------------------------------------------------------------------
def test_seed_workload_counts_are_the_seeds() -> None:
    timing = run_seed(FakeClock())
    assert timing.batch_size == 8
    assert timing.num_decode_steps == 31  # until the 32-token straggler is done
    assert timing.num_iterations == 32
    assert timing.token_slots == 256  # 8 rows x 32 forward passes
    assert timing.decode_token_slots == 248  # 8 x 31
    assert timing.useful_tokens == 52  # 7 x 3 + 31 decode tokens somebody wanted
    assert timing.collected_tokens == 60  # useful_tokens + batch_size
    assert timing.waste_fraction == pytest.approx(196 / 248)
    assert f"{timing.waste_fraction:.1%}" == "79.0%"


def test_each_row_keeps_exactly_its_first_max_tokens() -> None:
    timing = run_seed(FakeClock())
    assert timing.tokens["r0"] == (0, 1, 2, 3)
    assert timing.tokens["r6"] == (6000, 6001, 6002, 6003)
    assert timing.tokens["r7"] == tuple(7000 + k for k in range(32))
    assert timing.max_tokens == (4, 4, 4, 4, 4, 4, 4, 32)


def test_every_row_is_computed_at_every_step() -> None:
    clock = FakeClock()
    batch = ScriptedStaticBatch(SEED_MAX_TOKENS, clock, 2.0, 0.5)
    time_static_run(batch.prefill, batch.decode_step, max_tokens=SEED_MAX_TOKENS, clock=clock)
    assert batch.num_forwards == 32
    assert clock.num_iterations_done == 32


# --- times -----------------------------------------------------------------------------------------
def test_prefill_is_held_out_of_the_decode_denominator() -> None:
    timing = run_seed(FakeClock(), prefill_cost=2.0, step_cost=0.5)
    assert timing.prefill_time_s == 2.0
    assert timing.step_times_s == (0.5,) * 31
    assert timing.decode_time_s == pytest.approx(15.5)
    assert timing.decode_tps == pytest.approx(52 / 15.5)  # not 52 / 17.5


def test_end_to_end_goodput_covers_the_whole_run() -> None:
    timing = run_seed(FakeClock(), prefill_cost=2.0, step_cost=0.5)
    assert timing.makespan_s == pytest.approx(17.5)  # 2 + 31 x 0.5
    assert timing.end_to_end_goodput_tps == pytest.approx(60 / 17.5)


def test_every_row_is_handed_back_at_the_straggler_end() -> None:
    timing = run_seed(FakeClock(), prefill_cost=2.0, step_cost=0.5)
    assert timing.first_answer_s == pytest.approx(17.5)
    assert timing.mean_latency_s == pytest.approx(17.5)
    assert list(timing.latency_s.values()) == [pytest.approx(17.5)] * 8
    # ...although a short row had its last token after the prefill and 3 steps.
    assert timing.row_done_s("r0") == pytest.approx(3.5)
    assert timing.row_done_s("r7") == pytest.approx(17.5)


def test_unit_clock_counts_forward_passes() -> None:
    timing = run_seed(UnitClock())
    assert timing.clock_unit == "iterations"
    assert timing.prefill_time_s == 1.0
    assert timing.makespan_s == 32.0  # 1 prefill + 31 decode steps
    assert timing.end_to_end_goodput_tps == pytest.approx(60 / 32)


def test_wall_clock_runs() -> None:
    batch = ScriptedStaticBatch({"a": 2, "b": 3}, None, 0.0, 0.0)
    timing = time_static_run(batch.prefill, batch.decode_step, max_tokens={"a": 2, "b": 3}, clock=WallClock())
    assert timing.clock_unit == "s"
    assert timing.makespan_s >= 0.0
    assert timing.tokens == {"a": (0, 1), "b": (1000, 1001, 1002)}


def test_a_static_batch_waits_for_its_last_row() -> None:
    clock = FakeClock()
    max_tokens = {"a": 2, "b": 2}
    batch = ScriptedStaticBatch(max_tokens, clock, 1.0, 1.0)
    timing = time_static_run(
        batch.prefill, batch.decode_step, max_tokens=max_tokens, clock=clock, arrival_time_s={"b": 3.0}
    )
    assert timing.start_s == 3.0
    assert timing.makespan_s == 5.0  # wait 3, prefill 1, one step 1
    assert timing.latency_s == {"a": 5.0, "b": 2.0}
    assert timing.mean_latency_s == 3.5


def test_one_token_rows_need_no_decode_step() -> None:
    batch = ScriptedStaticBatch({"a": 1, "b": 1}, None, 0.0, 0.0)
    timing = time_static_run(batch.prefill, batch.decode_step, max_tokens={"a": 1, "b": 1}, clock=UnitClock())
    assert timing.num_decode_steps == 0
    assert timing.token_slots == 2
    assert timing.waste_fraction == 0.0
    assert timing.useful_tokens == 0
    assert timing.collected_tokens == 2
    assert math.isnan(timing.decode_tps)


def test_to_dict_is_json_ready() -> None:
    d = run_seed(UnitClock()).to_dict()
    json.dumps(d)
    assert d["token_slots"] == 256
    assert d["useful_tokens"] == 52
    assert d["makespan_s"] == 32.0


# --- refusals --------------------------------------------------------------------------------------
def test_a_step_that_skips_a_row_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="every row"):
        time_static_run(lambda: {"a": 1}, lambda: {"a": 1}, max_tokens={"a": 2, "b": 2}, clock=UnitClock())


def test_bad_batches_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        time_static_run(dict, dict, max_tokens={}, clock=UnitClock())
    with pytest.raises(ValueError, match="max_tokens"):
        time_static_run(lambda: {"a": 1}, dict, max_tokens={"a": 0}, clock=UnitClock())
    with pytest.raises(ValueError, match="unknown request"):
        time_static_run(
            lambda: {"a": 1}, dict, max_tokens={"a": 1}, clock=UnitClock(), arrival_time_s={"z": 1.0}
        )


# --- the workload ----------------------------------------------------------------------------------
def test_seed_workload_shape() -> None:
    w = seed_workload()
    assert len(w) == 8
    assert [r.max_tokens for r in w.requests] == [4] * 7 + [32]
    assert {r.prompt_len for r in w.requests} == {5}
    assert w.request_ids == [f"r{i}" for i in range(8)]


def test_resolve_gives_each_request_its_own_prompt() -> None:
    resolved = resolve_workload(seed_workload(), encode=lambda s: [1], vocab_size=49152)
    prompts = [r.prompt_token_ids for r in resolved]
    assert all(len(p) == 5 for p in prompts)
    assert len(set(prompts)) == 8
    assert all(1000 <= t < 49152 for p in prompts for t in p)
    assert prompts[0] == tuple(synthetic_prompt(0, 5, 49152))


def test_resolve_encodes_text_prompts() -> None:
    w = Workload((WorkloadRequest(max_tokens=2, prompt="hi"), WorkloadRequest(max_tokens=3, prompt_len=2)))
    resolved = resolve_workload(w, encode=lambda s: [ord(c) for c in s], vocab_size=300)
    assert resolved[0].prompt_token_ids == (104, 105)
    assert len(resolved[1].prompt_token_ids) == 2
    assert all(75 <= t < 300 for t in resolved[1].prompt_token_ids)  # clear of the low (special) ids


def test_workload_file_round_trip(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        '{"prompt": "Once upon a time", "max_tokens": 4}\n'
        "\n"
        '{"prompt_len": 5, "max_tokens": 32, "arrival_time_s": 0.5, "id": "straggler"}\n'
    )
    w = load_workload(path)
    assert w.request_ids == ["r0", "straggler"]
    assert w.requests[0].prompt == "Once upon a time"
    assert w.requests[1].prompt_len == 5
    assert w.requests[1].arrival_time_s == 0.5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt_len": 5}', "max_tokens is required"),
        ('{"max_tokens": 4}', "exactly one of prompt and prompt_len"),
        ('{"prompt": "x", "prompt_len": 3, "max_tokens": 4}', "exactly one of prompt and prompt_len"),
        ('{"prompt": "", "max_tokens": 4}', "non-empty string"),
        ('{"prompt_len": 0, "max_tokens": 4}', "prompt_len must be an integer >= 1"),
        ('{"prompt_len": 5, "max_tokens": 0}', "max_tokens must be an integer >= 1"),
        ('{"prompt_len": 5, "max_tokens": 2.5}', "max_tokens must be an integer >= 1"),
        ('{"prompt_len": 5, "max_tokens": true}', "max_tokens must be an integer >= 1"),
        ('{"prompt_len": 5, "max_tokens": 4, "arrival_time_s": -1}', "arrival_time_s"),
        ('{"prompt_len": 5, "max_tokens": 4, "arrival_time_s": "soon"}', "arrival_time_s"),
        ('{"prompt_len": 5, "max_tokens": 4, "temperature": 1}', "unknown keys \\['temperature'\\]"),
    ],
)
def test_bad_workload_lines_name_the_line(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_workload_lines(['{"prompt_len": 5, "max_tokens": 4}', line], source="w.jsonl")
    assert str(err.value).startswith("w.jsonl:2: ")


def test_duplicate_ids_and_empty_workloads_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="duplicate request ids"):
        parse_workload_lines(['{"prompt_len": 1, "max_tokens": 1, "id": "a"}'] * 2)
    with pytest.raises(ValueError, match="no requests"):
        parse_workload_lines(["", "  "])
    with pytest.raises(ValueError, match="cannot read workload file"):
        load_workload(tmp_path / "missing.jsonl")
