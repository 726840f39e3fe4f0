"""tokenmill/measure/cost_model.py against FLOP and byte counts worked out by hand for a tiny Llama."""

from types import SimpleNamespace

import pytest

from tokenmill.measure.cost_model import (
    SMOLLM2_135M,
    ModelShape,
    RowWork,
    forward_cost,
    ideal_forwards,
    lower_bound,
    workload_bound,
)

# hidden 8, intermediate 16, 2 layers, 2 heads of 4, 1 KV head, vocab 32.
TINY = ModelShape(
    hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=32
)


def test_parameter_counts():
    # q 8x8=64, k 8x4=32, v 32, o 64, gate/up/down 8x16=128 each -> 576 per layer.
    assert TINY.layer_matmul_params == 576
    assert TINY.matmul_params == 1152
    assert TINY.lm_head_params == 256
    # SmolLM2-135M: 30 * (2*576*576 + 2*576*192 + 3*576*1536) = 106,168,320.
    assert SMOLLM2_135M.matmul_params == 106_168_320


def test_from_config_reads_llama_names():
    cfg = SimpleNamespace(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=32,
    )
    assert ModelShape.from_config(cfg) == TINY
    cfg.head_dim = None  # derived from hidden / heads
    assert ModelShape.from_config(cfg) == TINY


def test_causal_pairs():
    assert RowWork(3, 3).num_causal_pairs == 1 + 2 + 3
    assert RowWork(1, 10).num_causal_pairs == 10
    assert RowWork(2, 5).num_causal_pairs == 4 + 5


def test_prefill_forward_by_hand():
    cost = forward_cost(TINY, [RowWork(num_new_tokens=3, seq_len=3, num_logit_rows=1)])
    # matmuls 2*1152*3 = 6912; attention 4*2 layers*2 heads*4*6 pairs = 384; LM head 2*256*1 = 512.
    assert cost.flops == 6912 + 384 + 512
    # weights (1152 + 256)*4 = 5632; KV 2 layers * (K, V) * 4 * 4 bytes * 3 positions = 192.
    assert cost.bytes == 5632 + 192


def test_lm_head_only_where_logits_are_needed():
    chunk = forward_cost(TINY, [RowWork(4, 4, num_logit_rows=0)])
    # matmuls 2*1152*4 = 9216; attention 4*2*2*4*10 = 640; no LM head FLOPs, no LM head bytes.
    assert chunk.flops == 9216 + 640
    assert chunk.bytes == 1152 * 4 + 2 * 2 * 4 * 4 * 4


def test_decode_batch_reads_weights_once_and_int8_weights():
    rows = [RowWork(1, 5), RowWork(1, 7)]
    cost = forward_cost(TINY, rows, weight_bytes=1.0, kv_bytes=2.0)
    # matmuls 2*1152*2 = 4608; attention 4*2*2*4*(5 + 7) = 768; LM head 2*256*2 = 1024.
    assert cost.flops == 4608 + 768 + 1024
    # weights (1152 + 256)*1 = 1408; KV 2*2*4*2 bytes*(5 + 7) = 384.
    assert cost.bytes == 1408 + 384


def test_ideal_schedule_and_bound():
    forwards = ideal_forwards([3, 2], [2, 1])
    assert forwards == [[RowWork(3, 3), RowWork(2, 2)], [RowWork(1, 4)]]
    prefill = forward_cost(TINY, forwards[0])
    decode = forward_cost(TINY, forwards[1])
    peak_flops, peak_bw = 1000.0, 1000.0
    bound = lower_bound(TINY, forwards, peak_flops, peak_bw)
    expected = max(prefill.flops, prefill.bytes) / 1000 + max(decode.flops, decode.bytes) / 1000
    assert bound.time_s == pytest.approx(expected)
    assert bound.num_forwards == 2
    assert bound.flops == prefill.flops + decode.flops
    assert bound.time_s >= max(bound.compute_s, bound.memory_s)
    assert workload_bound(TINY, [3, 2], [2, 1], peak_flops, peak_bw) == bound


def test_attention_at_its_own_peak():
    """Projections on one arithmetic, attention on another: each part's FLOPs at its own peak."""
    cost = forward_cost(TINY, [RowWork(4, 4)])
    assert cost.attention_flops == 640  # 4*2*2*4*10, as above
    assert cost.compute_s(4000.0, 1000.0) == pytest.approx((cost.flops - 640) / 4000 + 640 / 1000)
    assert cost.compute_s(1000.0) == pytest.approx(cost.flops / 1000)
    forwards = ideal_forwards([4], [2])
    bound = lower_bound(TINY, forwards, 4000.0, 1e9, attention_peak_flops=1000.0)
    costs = [forward_cost(TINY, rows) for rows in forwards]
    assert bound.time_s == pytest.approx(sum(c.compute_s(4000.0, 1000.0) for c in costs))
    assert bound.compute_s == pytest.approx(bound.time_s)
    assert bound.time_s > lower_bound(TINY, forwards, 4000.0, 1e9).time_s


def test_bad_input():
    with pytest.raises(ValueError):
        RowWork(0, 3)
    with pytest.raises(ValueError):
        RowWork(2, 3, num_logit_rows=3)
    with pytest.raises(ValueError):
        ideal_forwards([3], [0])
