"""The default arithmetic of a quantized GGUF: llama.cpp's where measured quality allows, else the exact path."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.model import arithmetic
from tokenmill.model.arithmetic import EXACT, LLAMA_CPP, Measured, choose

_EMBEDDED = ("llama", "Smollm2 135M 8k Lc100K Mix1 Ep2", 98_362_432)


def test_a_measured_model_within_the_rule_gets_llama_cpp_arithmetic() -> None:
    choice = choose(*_EMBEDDED, kernel_variant="avx2")
    assert choice.quantization == LLAMA_CPP
    assert "measured on SmolLM2-135M-Instruct" in choice.reason and "97.46%" in choice.reason
    assert "Q8_0/IQ4 tensors exact (rounded too: prose perplexity +0.37%, top-1 96.72%" in choice.reason


def test_the_same_name_at_another_size_is_another_file() -> None:
    choice = choose("llama", _EMBEDDED[1], _EMBEDDED[2] + 1, kernel_variant="avx512")
    assert choice.quantization == LLAMA_CPP and "not among the models measured" in choice.reason


@pytest.mark.parametrize(("rise_pct", "top1_pct"), [(1.2, 99.0), (0.1, 96.9), (0.5, 98.0)])
def test_a_measured_model_outside_the_rule_keeps_the_exact_path(
    monkeypatch: pytest.MonkeyPatch, rise_pct: float, top1_pct: float
) -> None:
    rise, top1 = {"prose": 0.1, "code": rise_pct}, {"prose": top1_pct, "code": 99.0}
    record = Measured("m", "qwen2", "M", 1000, rise, top1, "1/50", "t")
    monkeypatch.setattr(arithmetic, "MEASURED", (record,))
    choice = choose("qwen2", "M", 1000, kernel_variant="avx512")
    within = rise_pct <= 1.0 and top1_pct >= 97.0
    assert choice.quantization == (LLAMA_CPP if within else EXACT)
    assert ("outside the rule" in choice.reason) != within


def test_wide_quads_unless_measured_outside_the_rule_with_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 and IQ4 tensors take 8-bit activations (as in llama.cpp) unless the file was measured below the rule
    with them rounded; TOKENMILL_WIDE_QUADS overrides either way (the quality benchmark measures both)."""
    monkeypatch.delenv(arithmetic.WIDE_QUADS_ENV, raising=False)
    assert arithmetic.wide_quads(*_EMBEDDED) is False  # measured: top-1 96.72% with its Q8_0 head rounded
    assert arithmetic.wide_quads("llama", _EMBEDDED[1], _EMBEDDED[2] + 1) is True  # not measured
    record = Measured("m", "qwen2", "M", 1000, {"prose": 0.1}, {"prose": 99.0}, "1/50", "t")
    monkeypatch.setattr(
        arithmetic, "MEASURED", (record, dataclasses.replace(record, file_bytes=2, wide_exact=True))
    )
    assert (
        arithmetic.wide_quads("qwen2", "M", 1000) is True and arithmetic.wide_quads("qwen2", "M", 2) is False
    )
    monkeypatch.setenv(arithmetic.WIDE_QUADS_ENV, "1")
    assert arithmetic.wide_quads("qwen2", "M", 2) is True
    monkeypatch.setenv(arithmetic.WIDE_QUADS_ENV, "0")
    assert arithmetic.wide_quads("qwen2", "M", 1000) is False


def test_super_block_activations_unless_measured_outside_the_rule_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A K-quant's activations share a scale per super-block of 256 (llama.cpp's Q8_K) unless the file was measured
    below the rule that way; TOKENMILL_SUPER_BLOCK_ACTS overrides either way."""
    monkeypatch.delenv(arithmetic.SUPER_BLOCK_ACTS_ENV, raising=False)
    record = Measured("m", "qwen2", "M", 1000, {"prose": 0.1}, {"prose": 99.0}, "1/50", "t")
    per_group = dataclasses.replace(record, file_bytes=2, group_acts=True, per_super_block="top-1 95.00%")
    monkeypatch.setattr(arithmetic, "MEASURED", (record, per_group))
    assert arithmetic.super_block_acts("qwen2", "M", 1000) is True
    assert arithmetic.super_block_acts("qwen2", "M", 2) is False
    assert arithmetic.super_block_acts("qwen2", "M", 3) is True  # not measured: llama.cpp's
    assert "K-quants' activations per 32 (per 256: top-1 95.00%)" in choose("qwen2", "M", 2, "avx512").reason
    monkeypatch.setenv(arithmetic.SUPER_BLOCK_ACTS_ENV, "1")
    assert arithmetic.super_block_acts("qwen2", "M", 2) is True
    monkeypatch.setenv(arithmetic.SUPER_BLOCK_ACTS_ENV, "0")
    assert arithmetic.super_block_acts("qwen2", "M", 1000) is False


def test_without_an_integer_dot_product_the_exact_path_stays() -> None:
    for variant in ("base", None):
        choice = choose(*_EMBEDDED, kernel_variant=variant)
        assert choice.quantization == EXACT and "no integer dot product" in choice.reason


def test_every_measured_record_is_one_file_and_says_where() -> None:
    keys = [(m.architecture, m.general_name, m.file_bytes) for m in arithmetic.MEASURED]
    assert len(set(keys)) == len(keys) >= 4
    for m in arithmetic.MEASURED:
        assert set(m.perplexity_rise_pct) == set(m.top1_agreement_pct)
        assert "family" in m.where and "model" in m.where  # the CPU by family and model number
        assert dataclasses.replace(m, top1_agreement_pct={"prose": 50.0}).passes() is False


def test_the_embedded_file_is_the_measured_one() -> None:
    """The table knows the real file by its metadata and size: the embedded model loads on the rule's choice."""
    from tokenmill.model.cpu.kernels import loaded
    from tokenmill.model.embedded import embedded_model_path
    from tokenmill.model.gguf_loader import GGUFFile

    gguf_file = GGUFFile(embedded_model_path())
    choice = gguf_file.default_arithmetic(loaded().variant)
    if loaded().variant in arithmetic.INTEGER_DOT_VARIANTS:
        assert choice.quantization == LLAMA_CPP
        assert "measured on SmolLM2-135M-Instruct Q4_1 (embedded)" in choice.reason
    else:
        assert choice.quantization == EXACT


def test_kv_cache_dtype_resolution_and_refusals() -> None:
    from tokenmill.config import EngineConfig, resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("auto", "gguf-q8", "float32") == "float16"  # llama.cpp's arithmetic: f16 KV
    assert resolve_kv_cache_dtype("auto", "gguf-q4", "float32") == "float16"
    assert resolve_kv_cache_dtype("auto", "gguf", "float32") == "float32"  # the exact path keeps fp32
    assert resolve_kv_cache_dtype("auto", None, "bfloat16") == "bfloat16"  # a GPU's model dtype
    assert resolve_kv_cache_dtype("bf16", "gguf", "float32") == "bfloat16"
    assert resolve_kv_cache_dtype("fp32", "gguf-q8", "float32") == "float32"
    assert resolve_kv_cache_dtype("fp8", "gguf-q8", "float32") == "float8_e4m3fn"  # vLLM's fp8: e4m3
    assert resolve_kv_cache_dtype("fp8_e4m3", "gguf", "float32") == "float8_e4m3fn"
    assert resolve_kv_cache_dtype("int8", "gguf-q8", "float32") == "int8"
    for bad, words in (("fp8_e5m2", "fp8_e4m3 or int8"), ("float64", "kv_cache_dtype")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(kv_cache_dtype=bad)
