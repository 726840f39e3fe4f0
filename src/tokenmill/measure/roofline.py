"""Each engine step's fraction of the machine's limit: the FLOPs and bytes the step's rows cost (``cost_model``,
from the model's shapes and the batch) at the machine's peaks, over the step's wall time. Pure Python.

``bound_s = max(flops / peak_flops, bytes / peak_read_bw)`` is the least time any engine could take for the
step's work on this machine; ``fraction = bound_s / step_s`` says how close this one came (1 is the limit).
Steps are split by kind: ``decode`` (every row computes its next token), ``prefill`` (every row a prompt or a
chunk of one) and ``mixed``. The limits are measured once per machine and cached (``--hardware-limits cached``,
the server's default, ``model/hardware_cache.py``: the fp32 multiply-add's FLOP/s, the integer dot product's ops/s and read
bandwidth), measured again (``measure``) or given (``--hardware-limits GFLOPS,GBS``). A model on llama.cpp's
arithmetic (``gguf-q8``) has its projections and head bounded by the integer peak and its attention, which runs
in fp32, by the fp32 peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.config import parse_hardware_limits
from tokenmill.measure.cost_model import ModelShape, RowWork, forward_cost

STEP_KINDS = ("decode", "prefill", "mixed")


@dataclass(frozen=True)
class MachineLimits:
    peak_flops: float  # FLOP/s
    peak_read_bw: float  # bytes/s
    source: str = "given"
    peak_int_ops: float | None = None  # the 8-bit-activation kernels' integer dot product, ops/s (CPU)
    attention_peak_flops: float | None = None  # the attention's peak where it is not ``peak_flops``

    @classmethod
    def parse(cls, text: str) -> MachineLimits:
        """``"250,30"``: 250 GFLOP/s and 30 GB/s."""
        return cls(*parse_hardware_limits(text), "given")

    def for_integer_matmuls(self) -> MachineLimits:
        """The limits of a model whose projections run on integer dot products (``gguf-q8``): the projections
        and the head at the integer peak, the attention (fp32) at the fp32 peak. Unchanged where no integer peak
        was measured."""
        if not self.peak_int_ops:
            return self
        source = f"{self.source}; integer peak"
        return MachineLimits(self.peak_int_ops, self.peak_read_bw, source, None, self.peak_flops)

    def describe(self) -> str:
        text = f"{self.peak_flops / 1e9:.1f} GFLOP/s, {self.peak_read_bw / 1e9:.1f} GB/s"
        if self.peak_int_ops:
            text += f", integer {self.peak_int_ops / 1e9:.1f} GOP/s"
        if self.attention_peak_flops:
            text += f", attention {self.attention_peak_flops / 1e9:.1f} GFLOP/s"
        return f"{text} ({self.source})"


def step_kind(rows: Sequence[Any]) -> str:
    """``rows``: a step's ``ScheduledRow``s (non-empty)."""
    prefill = sum(1 for r in rows if r.is_prefill)
    return "prefill" if prefill == len(rows) else "decode" if prefill == 0 else "mixed"


class StepRoofline:
    """The bound of one step's rows on one machine, for one model as loaded (its bytes per weight and per KV
    element)."""

    def __init__(
        self, shape: ModelShape, limits: MachineLimits, weight_bytes: float, kv_bytes: float
    ) -> None:
        self.shape, self.limits = shape, limits
        self.weight_bytes, self.kv_bytes = weight_bytes, kv_bytes

    def bound_s(self, rows: Sequence[Any]) -> float:
        # a row samples at its last position, a verification row (num_spec_tokens) at each of its positions
        work = [
            RowWork(
                len(r.token_ids),
                r.start_position + len(r.token_ids),
                (len(r.token_ids) if r.num_spec_tokens else 1) if r.sample else 0,
            )
            for r in rows
        ]
        cost = forward_cost(self.shape, work, self.weight_bytes, self.kv_bytes)
        return cost.time_s(self.limits.peak_flops, self.limits.peak_read_bw, self.limits.attention_peak_flops)
