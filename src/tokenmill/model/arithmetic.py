"""Which arithmetic a GGUF gets when none is asked for, and why: the exact path or llama.cpp's.

``"gguf"`` (exact) multiplies fp32 activations by the blocks' exact values; ``"gguf-q8"`` (llama.cpp's
arithmetic) rounds the activations to 8 bits, with one scale per super-block of 256 inputs in front of a K-quant
(llama.cpp's Q8_K) and per group of 32 elsewhere (its Q8_0 and Q8_1), and multiplies them by the blocks' codes with
integer dot products, as llama.cpp, Ollama and vLLM's GGUF kernels compute every GGUF. The second is faster (on 2 Zen 4
cores the 1.5B prefills 1,024 tokens in 5.1-6.0 s instead of 13.8-14.3 s, 2026-12-06) and costs at most 0.42% of
perplexity and 1.8 points of top-1 agreement with the exact path on the models measured below.

The rule: llama.cpp's arithmetic is a model's default where ``benchmarks/arithmetic_quality.py`` measured its
perplexity rising at most :data:`MAX_PERPLEXITY_RISE_PCT` on every text and top-1 agreement with the exact path at
least :data:`MIN_TOP1_AGREEMENT_PCT`; a measured model outside it keeps the exact path, and one within it only
with its Q8_0 and IQ4 tensors on the exact path keeps those there (:attr:`Measured.wide_exact`,
:func:`wide_quads`). A file not measured here gets llama.cpp's arithmetic, the one every other GGUF runner gives
it, Q8_0 and IQ4 tensors included (the benchmark measures it:
``python -m benchmarks.arithmetic_quality --model PATH``). Without an integer dot-product kernel (the portable
``base`` build computes it in plain loops) the exact path stays.

Torch-free: the loader asks, ``tokenmill info --load``, the server's start line and ``/v1/models`` report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

EXACT, LLAMA_CPP = "gguf", "gguf-q8"
MAX_PERPLEXITY_RISE_PCT = 1.0
MIN_TOP1_AGREEMENT_PCT = 97.0
# the kernel variants whose 8-bit-activation path runs on integer dot products (csrc/simd.h's qdot)
INTEGER_DOT_VARIANTS = ("avx512", "avxvnni", "avx2")


@dataclass(frozen=True)
class Measured:
    """One model file as ``benchmarks/arithmetic_quality.py`` measured it: the file is known by its GGUF
    ``general.architecture``, ``general.name`` and size in bytes. Per text (``prose``, ``code``): perplexity rise
    of llama.cpp's arithmetic over the exact path in percent, and top-1 agreement in percent (about 20,000 tokens
    each); ``greedy``: identical greedy outputs of 50 chat prompts of 64 tokens."""

    name: str
    architecture: str
    general_name: str
    file_bytes: int
    perplexity_rise_pct: dict[str, float]
    top1_agreement_pct: dict[str, float]
    greedy: str
    where: str  # the date and CPU of the measurement
    # The file's Q8_0 and IQ4 tensors (wide byte quads) kept exact: measured outside the rule with them rounded
    # too (``rounded``: those numbers); the figures above are with them exact.
    wide_exact: bool = False
    rounded: str = ""
    # The K-quants' activations rounded per group of 32, not per super-block of 256 (llama.cpp's Q8_K): measured
    # outside the rule per super-block (``per_super_block``: those numbers); the figures above are per group of 32.
    group_acts: bool = False
    per_super_block: str = ""

    def passes(self) -> bool:
        return (
            max(self.perplexity_rise_pct.values()) <= MAX_PERPLEXITY_RISE_PCT
            and min(self.top1_agreement_pct.values()) >= MIN_TOP1_AGREEMENT_PCT
        )

    def summary(self) -> str:
        texts = ", ".join(
            f"{text} perplexity {self.perplexity_rise_pct[text]:+.2f}%, top-1 {self.top1_agreement_pct[text]:.2f}%"
            for text in self.perplexity_rise_pct
        )
        wide = f"; its Q8_0/IQ4 tensors exact (rounded too: {self.rounded})" if self.wide_exact else ""
        group = (
            f"; its K-quants' activations per 32 (per 256: {self.per_super_block})" if self.group_acts else ""
        )
        return f"{texts}; greedy identical {self.greedy}{wide}{group} ({self.where})"


_ZEN4_LATER = "2026-12-06, AMD EPYC family 25 model 17"
MEASURED = (
    Measured(
        "SmolLM2-135M-Instruct Q4_1 (embedded)", "llama", "Smollm2 135M 8k Lc100K Mix1 Ep2", 98_362_432,
        {"prose": 0.165}, {"prose": 97.46}, "17/50", _ZEN4_LATER,
        wide_exact=True, rounded="prose perplexity +0.37%, top-1 96.72%, greedy identical 11/50",
    ),
    Measured(
        "gemma-3-270m Q4_K_M", "gemma3", "Gemma 3 270m", 253_113_024,
        {"prose": 0.129}, {"prose": 97.18}, "32/50", _ZEN4_LATER,
        wide_exact=True, rounded="prose perplexity -0.06%, top-1 96.54%, greedy identical 31/50",
        group_acts=True, per_super_block="prose perplexity +0.34%, top-1 95.26%, greedy identical 24/50",
    ),
    Measured(
        "qwen2.5-coder-0.5b-instruct Q4_K_M", "qwen2", "Qwen2.5 Coder 0.5B Instruct AWQ", 491_400_064,
        {"prose": 0.129, "code": 0.067}, {"prose": 98.51, "code": 99.19}, "24/50", _ZEN4_LATER,
    ),
    Measured(
        "qwen2.5-coder-1.5b-instruct Q4_K_M", "qwen2", "Qwen2.5 Coder 1.5B Instruct GGUF", 1_117_320_768,
        {"prose": 0.248, "code": 0.423}, {"prose": 98.22, "code": 98.79}, "22/50", _ZEN4_LATER,
    ),
)  # fmt: skip


@dataclass(frozen=True)
class Choice:
    quantization: str  # EXACT or LLAMA_CPP
    reason: str


def describe(quantization: str | None) -> str:
    """What a quantization computes, in a few words (the start line and ``/v1/models``)."""
    return {
        EXACT: "exact: fp32 activations times the blocks' exact values",
        LLAMA_CPP: "llama.cpp's arithmetic: activations rounded to 8 bits (per 256 for K-quants, else per 32), "
        "integer dot products",
        "gguf-q4": "llama.cpp's arithmetic on weights rounded to 4 bits at load (approximate)",
        "fp32": "fp32 weights dequantized at load",
        "int8": "weight-only int8 made from the fp32 weights",
    }.get(quantization or "", "the weights in their dtype")


def measured(architecture: str, general_name: str, file_bytes: int) -> Measured | None:
    for m in MEASURED:
        if (m.architecture, m.general_name, m.file_bytes) == (architecture, general_name, file_bytes):
            return m
    return None


# TOKENMILL_WIDE_QUADS=1 or 0 overrides the measured choice of wide_quads (benchmarks/arithmetic_quality.py)
WIDE_QUADS_ENV = "TOKENMILL_WIDE_QUADS"


def wide_quads(architecture: str, general_name: str, file_bytes: int) -> bool:
    """Whether llama.cpp's arithmetic rounds the activations of a file's Q8_0 and IQ4 tensors too (as llama.cpp
    does): yes unless the file was measured outside the rule that way (:attr:`Measured.wide_exact`)."""
    return _unless_measured_otherwise(
        WIDE_QUADS_ENV, measured(architecture, general_name, file_bytes), "wide_exact"
    )


# TOKENMILL_SUPER_BLOCK_ACTS=1 or 0 overrides the measured choice of super_block_acts
SUPER_BLOCK_ACTS_ENV = "TOKENMILL_SUPER_BLOCK_ACTS"


def super_block_acts(architecture: str, general_name: str, file_bytes: int) -> bool:
    """Whether llama.cpp's arithmetic rounds a K-quant's activations per super-block of 256 inputs, one scale each
    (as llama.cpp does: its Q8_K), rather than per group of 32: yes unless the file was measured outside the rule
    that way (:attr:`Measured.group_acts`)."""
    m = measured(architecture, general_name, file_bytes)
    return _unless_measured_otherwise(SUPER_BLOCK_ACTS_ENV, m, "group_acts")


def _unless_measured_otherwise(env: str, m: Measured | None, otherwise: str) -> bool:
    """True unless the environment variable ``env`` says 0 (1 says True) or, without it, the measured record
    ``m`` has its field ``otherwise`` set."""
    override = os.environ.get(env)
    if override in ("0", "1"):
        return override == "1"
    return m is None or not getattr(m, otherwise)


def choose(architecture: str, general_name: str, file_bytes: int, kernel_variant: str | None) -> Choice:
    """The default arithmetic of a quantized GGUF on CPU with the C++ kernels loaded (``kernel_variant``)."""
    if kernel_variant not in INTEGER_DOT_VARIANTS:
        return Choice(
            EXACT, f"the {kernel_variant} kernels have no integer dot product; the exact path is faster"
        )
    m = measured(architecture, general_name, file_bytes)
    if m is None:
        return Choice(
            LLAMA_CPP,
            "this file is not among the models measured here; llama.cpp's arithmetic, as every GGUF runner "
            "computes it (python -m benchmarks.arithmetic_quality --model PATH measures it)",
        )
    rule = (
        f"rule: perplexity +{MAX_PERPLEXITY_RISE_PCT:g}% at most, top-1 {MIN_TOP1_AGREEMENT_PCT:g}% at least"
    )
    if m.passes():
        return Choice(LLAMA_CPP, f"measured on {m.name}: {m.summary()}; within the {rule}")
    return Choice(EXACT, f"llama.cpp's arithmetic measured on {m.name}: {m.summary()}; outside the {rule}")
