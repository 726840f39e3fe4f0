"""The traffic format, the iteration clock of the recorder, and ``tokenmill bench replay`` on synthetic recordings
(no model: the replay's fake model and the real scheduler)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.replay import ReplayConfig, parse_what_if, replay_unit
from tokenmill.cli import main
from tokenmill.measure.traffic import (
    Traffic,
    TrafficRequest,
    header_line,
    parse_traffic,
    prefix_keys,
    synthetic_prompt,
)
from tokenmill.server.recorder import IterationClock

CONFIG = {"block_size": 16, "num_kv_blocks": 1000, "max_num_seqs": 8, "max_num_batched_tokens": 2048,
          "max_model_len": 2048, "reserve": "none", "enable_prefix_caching": True}  # fmt: skip


def seed_traffic() -> Traffic:
    """The seed's workload as a recording: eight 5-token prompts at once, seven of 4 tokens, then one of 32."""
    lengths = [4] * 7 + [32]
    requests = [
        TrafficRequest(request_id=f"r{i}", arrival_s=0.0, arrival_iteration=0.0, arrival_index=i,
                       num_prompt_tokens=5, prefix_keys=[], max_tokens=n, num_output_tokens=n, finish_reason="length")
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    return Traffic(config=dict(CONFIG), requests=requests)


def write(path: Path, traffic: Traffic) -> Path:
    lines = [header_line(traffic.config, "m", "2026-12-02T00:00:00+00:00")]
    lines += [r.to_line() for r in reversed(traffic.requests)]  # written as they finish: any order
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prefix_keys_chain_and_salt() -> None:
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    assert len(prefix_keys(a, 16)) == 2  # the 8-token tail is no block
    assert prefix_keys(a, 16) == prefix_keys(b, 16)  # same first 32 tokens
    assert (
        prefix_keys([5] + a[1:], 16)[1] != prefix_keys(a, 16)[1]
    )  # chained: block 1's key depends on block 0
    assert prefix_keys(a, 16, salt="x") != prefix_keys(a, 16)
    assert all(len(k) == 16 for k in prefix_keys(a, 16))


def test_synthetic_prompts_share_exactly_the_recorded_blocks() -> None:
    keys = prefix_keys(list(range(48)), 16)
    r1 = TrafficRequest("a", 0, 0, 40, keys[:2], 8, 4, "stop")
    r2 = TrafficRequest("b", 0, 0, 50, keys[:3], 8, 4, "stop")
    p1, p2 = synthetic_prompt(r1, 16), synthetic_prompt(r2, 16)
    assert (len(p1), len(p2)) == (40, 50)
    assert p1[:32] == p2[:32] and p1[32:40] != p2[32:40]
    assert prefix_keys(p1, 16) == prefix_keys(p2, 16)[:2]


def test_parse_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    header = header_line(CONFIG, "m", "t")
    with pytest.raises(ValueError, match="no header"):
        parse_traffic([])
    with pytest.raises(ValueError, match=":1: a request before the header"):
        parse_traffic([seed_traffic().requests[0].to_line() + "\n"])
    with pytest.raises(ValueError, match=":2: unknown fields"):
        parse_traffic([header + "\n", json.dumps({"kind": "request", "bogus": 1}) + "\n"])
    with pytest.raises(ValueError, match=":2: not JSON"):
        parse_traffic([header + "\n", "{oops\n", "\n"])
    with pytest.raises(ValueError, match="lacks num_kv_blocks, max_num_seqs"):
        parse_traffic([json.dumps({"kind": "header", "version": 1, "config": {"block_size": 16}}) + "\n"])
    # a last line cut short (a server killed mid-write) is dropped, not an error
    line = seed_traffic().requests[0].to_line()
    traffic = parse_traffic([header + "\n", line + "\n", line[:20]])
    assert len(traffic.requests) == 1


def test_replay_reproduces_the_seed_and_its_pool_of_four(tmp_path: Path) -> None:
    traffic = seed_traffic()
    base = ReplayConfig.of(traffic)
    r = replay_unit(traffic, base)
    assert (r.timing.num_iterations, r.timing.token_slots, f"{r.timing.occupancy:.3f}") == (32, 60, "0.234")
    assert r.timing.batch_sizes == (8, 8, 8, 8) + (1,) * 28
    worst = replay_unit(traffic, base.with_changes({"num_kv_blocks": 4, "reserve": "worst_case"}))
    assert (worst.timing.num_iterations, f"{worst.timing.occupancy:.3f}") == (40, "0.188")
    assert max(worst.queue_iterations.values()) == 8  # the long request waits for two waves of short ones


def test_preemption_and_recompute_are_counted() -> None:
    """Eight 40-token answers in a pool of 12 blocks of 16: the pool runs dry, requests are preempted and
    recomputed; every block comes back (replay_unit checks the pool's integrity)."""
    requests = [
        TrafficRequest(f"r{i}", 0.0, 0.0, 20, [], 40, 40, "length", arrival_index=i) for i in range(8)
    ]
    traffic = Traffic(config={**CONFIG, "num_kv_blocks": 12}, requests=requests)
    r = replay_unit(traffic, ReplayConfig.of(traffic))
    d = r.as_dict()
    assert d["num_preemptions"] > 0 and d["num_recomputed_tokens"] > 0
    assert 0 < d["recompute_waste"] < 1
    assert sum(len(t) for t in r.timing.tokens.values()) == 8 * 40  # every recorded token produced once


def test_a_request_that_could_never_fit_is_refused_not_run() -> None:
    requests = [TrafficRequest("big", 0.0, 0.0, 100, [], 200, 10, "stop"), TrafficRequest("ok", 0.0, 0.0, 5, [], 4, 4, "length", arrival_index=1)]  # fmt: skip
    traffic = Traffic(config=dict(CONFIG), requests=requests)
    r = replay_unit(traffic, ReplayConfig.of(traffic).with_changes({"num_kv_blocks": 4}))
    assert (r.num_refused, r.num_replayed) == (1, 1)


def test_arrivals_and_early_stops() -> None:
    """A request arriving at iteration 10.5 is admitted at 11; one that stopped after 3 of 64 tokens stops there."""
    requests = [
        TrafficRequest("a", 0.0, 0.0, 5, [], 64, 3, "stop"),
        TrafficRequest("b", 1.0, 10.5, 5, [], 8, 8, "length", arrival_index=1),
        TrafficRequest("c", 1.0, 10.5, 5, [], 8, 0, "abort", arrival_index=2),  # ended before its first token
    ]
    traffic = Traffic(config=dict(CONFIG), requests=requests)
    r = replay_unit(traffic, ReplayConfig.of(traffic))
    assert r.num_skipped == 1 and r.num_replayed == 2
    assert len(r.timing.tokens["a"]) == 3 and len(r.timing.tokens["b"]) == 8
    assert r.timing.arrival_time_s["b"] == 10.5
    assert r.timing.finish_time_s["b"] == 11 + 8  # admitted at 11, 8 iterations


def test_what_if_parsing() -> None:
    assert parse_what_if("num_kv_blocks=64, max-num-seqs=4,reserve=worst_case,enable_prefix_caching=false") == {
        "num_kv_blocks": 64, "max_num_seqs": 4, "reserve": "worst_case", "enable_prefix_caching": False}  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_what_if("num_kv_blocks")
    with pytest.raises(ValueError, match="integer"):
        parse_what_if("num_kv_blocks=lots")
    with pytest.raises(ValueError, match="unknown what-if"):
        ReplayConfig.of(seed_traffic()).with_changes({"num_gpus": 2})


def test_cli_prints_the_recorded_config_and_the_what_ifs_side_by_side(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "seed.jsonl", seed_traffic())
    out_json = tmp_path / "out.json"
    assert main(["bench", "replay", str(path), "--num-kv-blocks", "4", "--what-if", "num_kv_blocks=4,reserve=worst_case",
                 "--no-enable-prefix-caching", "--json", str(out_json)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if "recorded" in line and "num_kv_blocks=4" in line)
    assert head.split() == [
        "recorded",
        "num_kv_blocks=4",
        "no",
        "prefix",
        "caching",
        "num_kv_blocks=4,reserve=worst_case",
    ]
    iterations = next(line for line in out.splitlines() if line.startswith("iterations")).split()[1:]
    assert iterations == ["32", "36", "32", "40"]
    occupancy = next(line for line in out.splitlines() if line.startswith("occupancy")).split()[1:]
    assert occupancy == ["0.234", "0.208", "0.234", "0.188"]
    results = json.loads(out_json.read_text())
    assert [r["num_iterations"] for r in results] == [32, 36, 32, 40]


def test_cli_refuses_a_bad_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["bench", "replay", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_iteration_clock_counts_idle_gaps_in_mean_steps() -> None:
    clock = IterationClock(start_s=0.0)
    assert clock.now(5.0) == 0.0  # no step yet: a gap is worth nothing
    clock.step(5.0, 5.1, has_work=True)
    clock.step(5.1, 5.2, has_work=False)  # idle from 5.2, mean step 0.1 s
    assert clock.now(5.2) == pytest.approx(2.0)
    assert clock.now(6.2) == pytest.approx(12.0)  # 1 s idle = 10 mean steps
    clock.step(6.2, 6.3, has_work=True)
    assert clock.now(6.3) == pytest.approx(13.0)  # busy: steps count, the gap is kept


def test_record_and_tracing_are_refused_with_ray_replicas(tmp_path: Path, capsys) -> None:
    for flag, value in (("--record", str(tmp_path / "r.jsonl")), ("--otlp-traces-endpoint", "http://x:4318")):
        assert main(["serve", "--ray", flag, value]) == 2
        assert f"{flag} is not supported with --ray" in capsys.readouterr().err
    assert main(["serve", "--record-text"]) == 2  # --record-text alone asks for nothing it could do
    assert "--record-text needs --record" in capsys.readouterr().err
