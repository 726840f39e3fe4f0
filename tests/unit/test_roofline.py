"""Each step's roofline bound (tokenmill.measure.roofline) against the cost model's FLOPs and bytes, worked by hand."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ScheduledRow
from tokenmill.measure.cost_model import ModelShape
from tokenmill.measure.roofline import MachineLimits, StepRoofline, step_kind
from tokenmill.stats import EngineStats

# one layer, hidden 4, 2 heads of 2 (1 KV head), MLP 8, vocab 10
SHAPE = ModelShape(hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2,
                   vocab_size=10)  # fmt: skip
P_MM = 4 * 4 + 2 * 4 * 2 + 4 * 4 + 3 * 4 * 8  # q, k+v, o, gate/up/down = 144
P_HEAD = 40


def row(start: int, n: int, sample: bool = True, prefill: bool = False, spec: int = 0) -> ScheduledRow:
    return ScheduledRow("r", list(range(n)), start, [0], sample, prefill, num_spec_tokens=spec)


def test_a_decode_step_is_bound_by_its_bytes() -> None:
    limits = MachineLimits(peak_flops=1e12, peak_read_bw=1e9)
    roof = StepRoofline(SHAPE, limits, weight_bytes=0.5, kv_bytes=4)
    rows = [row(9, 1), row(19, 1)]  # contexts 10 and 20
    weights = (P_MM + P_HEAD) * 0.5
    kv = 1 * 2 * 2 * 4 * (10 + 20)  # layers x (K and V) x kv_dim x bytes x context
    assert roof.bound_s(rows) == pytest.approx((weights + kv) / 1e9)
    assert step_kind(rows) == "decode"


def test_a_prefill_step_is_bound_by_its_flops() -> None:
    limits = MachineLimits(peak_flops=1e3, peak_read_bw=1e12)
    roof = StepRoofline(SHAPE, limits, weight_bytes=4, kv_bytes=4)
    rows = [
        row(0, 6, prefill=True),
        row(0, 4, sample=False, prefill=True),
    ]  # the second is a chunk: no logits
    pairs = 6 * 7 // 2 + 4 * 5 // 2
    flops = 2 * P_MM * 10 + 4 * 1 * 2 * 2 * pairs + 2 * P_HEAD * 1
    assert roof.bound_s(rows) == pytest.approx(flops / 1e3)
    assert step_kind(rows) == "prefill"
    assert step_kind([row(0, 6, prefill=True), row(9, 1)]) == "mixed"


def test_a_verification_row_needs_logits_for_every_token() -> None:
    roof = StepRoofline(SHAPE, MachineLimits(1e3, 1e12), 4, 4)
    one = roof.bound_s([row(9, 1)])
    spec = roof.bound_s([row(9, 4, spec=3)])
    pairs = 13 * 14 // 2 - 9 * 10 // 2
    assert spec == pytest.approx((2 * P_MM * 4 + 4 * 2 * 2 * pairs + 2 * P_HEAD * 4) / 1e3)
    assert spec > 3 * one


def test_integer_projections_beside_fp32_attention() -> None:
    """llama.cpp's arithmetic: the projections and the head at the integer peak, the attention at the fp32 one."""
    limits = MachineLimits(1e3, 1e12, "given", peak_int_ops=4e3).for_integer_matmuls()
    assert (limits.peak_flops, limits.attention_peak_flops) == (4e3, 1e3)
    assert "attention 0.0 GFLOP/s" in limits.describe()
    roof = StepRoofline(SHAPE, limits, weight_bytes=1, kv_bytes=4)
    pairs = 6 * 7 // 2
    projections, attention = 2 * P_MM * 6 + 2 * P_HEAD, 4 * 1 * 2 * 2 * pairs
    assert roof.bound_s([row(0, 6, prefill=True)]) == pytest.approx(projections / 4e3 + attention / 1e3)
    # without a measured integer peak the limits stay the fp32 ones, every FLOP at that peak
    plain = MachineLimits(1e3, 1e12)
    assert plain.for_integer_matmuls() is plain
    fp32 = StepRoofline(SHAPE, plain, 4, 4).bound_s([row(0, 6, prefill=True)])
    assert fp32 == pytest.approx((projections + attention) / 1e3)


def test_limits_parse_and_refuse() -> None:
    assert MachineLimits.parse("250,30") == MachineLimits(250e9, 30e9, "given")
    for bad in ("fast", "250", "250,0", "-1,30"):
        with pytest.raises(ValueError, match="hardware_limits"):
            MachineLimits.parse(bad)
        with pytest.raises(ValueError, match="hardware_limits"):
            EngineConfig(hardware_limits=bad)
    assert EngineConfig(hardware_limits="measure").hardware_limits == "measure"


def test_stats_sum_bounds_and_times_by_kind() -> None:
    stats = EngineStats()
    stats.add_roofline("decode", 0.01, 0.02)
    stats.add_roofline("decode", 0.01, 0.02)
    stats.add_roofline("prefill", 0.3, 0.4)
    assert stats.roofline_fraction_by_kind == pytest.approx({"decode": 0.5, "prefill": 0.75})
    totals = stats.totals()
    stats.add_roofline("decode", 1, 1)
    assert totals.num_roofline_steps == {"decode": 2, "prefill": 1}  # a copy, not a view
