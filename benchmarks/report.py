"""The suite's table and its target checks, from results already measured. Pure Python."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import RunResult

# (case, slower engine, faster engine, minimum of slower_time / faster_time). "tokenmill" is the default: the
# GGUF's blocks on the arithmetic model/arithmetic.py chooses (llama.cpp's, gguf-q8, for the measured models);
# "tokenmill_gguf" the exact path (fp32 activations times the blocks' values); "tokenmill_fp32" the same file
# dequantized at load.
SPEEDUP_TARGETS = [
    ("b", "hf", "tokenmill", 3.0),
    ("b", "hf_cb", "tokenmill", 6.0),
    (
        "c",
        "llamacpp",
        "tokenmill",
        1.25,
    ),  # single-stream decode: the default 1.25x llama.cpp on the same file
    ("d", "llamacpp", "tokenmill", 2.5),  # prefill of 1,024 tokens: 2.5x llama.cpp
    (
        "c",
        "tokenmill_gguf",
        "tokenmill",
        1.0,
    ),  # 8-bit activations never slower than the exact path at one row
    ("b", "tokenmill_fp32", "tokenmill_gguf", 1.0),  # the exact path no slower than the fp32 weights
    ("c", "llamacpp", "tokenmill_int8", 1.0),
]
# (case, engine, minimum fraction of that engine's lower bound, for the bytes it reads per weight and the peak of
# its arithmetic: fp32 FLOP/s, or for llama.cpp's the integer dot product's ops/s for the projections and the head
# beside fp32 FLOP/s for the attention)
LIMIT_TARGETS = [
    ("b", "tokenmill", 0.60),
    ("c", "tokenmill", 0.80),  # decode: 80% of read bandwidth
    ("d", "tokenmill", 0.60),  # int8 prefill: 60% of the integer peak
    ("c", "tokenmill_gguf", 0.80),
    ("d", "tokenmill_gguf", 0.85),  # the exact path's prefill: 85% of the fp32 limit
    ("c", "tokenmill_fp32", 0.80),
]
OVERHEAD_TARGET = 0.10


@dataclass(frozen=True)
class Check:
    name: str
    value: float | None
    target: str
    passed: bool | None  # None: not measured

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[self.passed]
        shown = "not measured" if self.value is None else f"{self.value:.3g}"
        return f"  [{verdict}] {self.name}: {shown} (target {self.target})"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "target": self.target, "passed": self.passed}


def _find(results: Sequence[RunResult], case: str, engine: str) -> RunResult | None:
    for r in results:
        if r.case == case and r.engine == engine and r.ok:
            return r
    return None


def fraction_of_limit(result: RunResult) -> float | None:
    limit = result.extra.get("limit_s")
    if result.time_s is None or limit is None:
        return None
    return float(limit) / result.time_s


def check_targets(results: Sequence[RunResult], overhead: dict[str, float] | None) -> list[Check]:
    checks = []
    for case, slower, faster, minimum in SPEEDUP_TARGETS:
        ours, theirs = _find(results, case, faster), _find(results, case, slower)
        ratio = theirs.time_s / ours.time_s if ours and theirs and ours.time_s and theirs.time_s else None
        checks.append(
            Check(
                f"({case}) {slower} time / {faster} time",
                ratio,
                f">= {minimum:g}",
                None if ratio is None else ratio >= minimum,
            )
        )
    for case, engine, minimum in LIMIT_TARGETS:
        found = _find(results, case, engine)
        frac = fraction_of_limit(found) if found else None
        checks.append(
            Check(
                f"({case}) {engine} fraction of the limit",
                frac,
                f">= {minimum:.0%}",
                None if frac is None else frac >= minimum,
            )
        )
    b, e = _find(results, "b", "tokenmill"), _find(results, "e", "tokenmill")
    growth = e.s_per_token / b.s_per_token if b and e and b.s_per_token and e.s_per_token else None
    checks.append(
        Check(
            "(e) tokenmill time per token / (b)'s", growth, "<= 1", None if growth is None else growth <= 1.0
        )
    )
    frac = overhead.get("overhead_fraction") if overhead else None
    if frac is not None and frac != frac:  # NaN: the forward was not observed
        frac = None
    checks.append(
        Check(
            f"engine overhead at batch {overhead.get('batch_size', 64) if overhead else 64}",
            frac,
            f"< {OVERHEAD_TARGET:.0%}",
            None if frac is None else frac < OVERHEAD_TARGET,
        )
    )
    return checks


def _fmt(value: float | None, spec: str) -> str:
    """``spec`` is "<width>.<precision>f"; a missing value is a right-aligned dash of that width."""
    width = int(spec.split(".")[0])
    return "-".rjust(width) if value is None else format(value, spec)


def _short(text: str, limit: int = 70) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pct(value: float | None, width: int) -> str:
    return ("-" if value is None else f"{100 * value:.1f}%").rjust(width)


def table(results: Sequence[RunResult], agreement: dict[tuple[str, str], float]) -> str:
    """One row per (case, engine): time, useful tokens/s, ms/token, time over tokenmill's, limit, agreement."""
    header = (
        f"{'case':<4} {'engine':<15} {'time s':>9} {'tok/s':>8} {'ms/tok':>8} {'x tm':>7} "
        f"{'limit s':>8} {'% limit':>8} {'agree':>6}  status"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        ours = _find(results, r.case, "tokenmill")
        ratio = r.time_s / ours.time_s if r.ok and ours and ours.time_s and r.time_s else None
        tps = r.num_output_tokens / r.time_s if r.ok and r.time_s else None
        spt = r.s_per_token
        frac = fraction_of_limit(r)
        agree = agreement.get((r.case, r.engine))
        lines.append(
            f"{r.case:<4} {r.engine:<15} {_fmt(r.time_s, '9.2f')} {_fmt(tps, '8.1f')} "
            f"{_fmt(None if spt is None else 1e3 * spt, '8.2f')} {_fmt(ratio, '7.2f')} "
            f"{_fmt(r.extra.get('limit_s'), '8.2f')} {_pct(frac, 8)} {_pct(agree, 6)}  {_short(r.status)}"
        )
    return "\n".join(lines)


def agreement(results: Sequence[RunResult]) -> dict[tuple[str, str], float]:
    """Per (case, engine): the share of requests whose tokens equal tokenmill's (greedy, same prompts)."""
    out = {}
    for r in results:
        ours = _find(results, r.case, "tokenmill")
        if not r.ok or ours is None or r.output_token_ids is None or ours.output_token_ids is None:
            continue
        same = sum(a == b for a, b in zip(r.output_token_ids, ours.output_token_ids, strict=True))
        out[(r.case, r.engine)] = same / len(ours.output_token_ids)
    return out
