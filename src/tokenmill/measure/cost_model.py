"""FLOPs and bytes of a Llama forward pass, and the lower bound they put on a workload's time. Pure Python.

One forward computes a flat batch of rows; row ``r`` computes ``n_r`` new tokens whose context ends at
``L_r`` (``seq_len``), and ``s_r`` of its positions need logits (1 when it samples, 0 for a prompt chunk
that does not)::

    flops = 2 * P_mm * sum(n_r)                         matmul weights, every new token
          + 4 * layers * heads * head_dim * pairs       QK^T and PV; pairs = causal (query, key) pairs
          + 2 * P_head * sum(s_r)                       LM head, only rows that need logits
    bytes = P_mm * w + (P_head * w if any s_r)          every weight read once per forward
          + layers * 2 * kv_dim * kv * sum(L_r)         each row's keys and values read once

with ``P_mm`` the decoder's projection parameters, ``P_head = hidden * vocab``, ``w`` and ``kv`` the
bytes per weight and per KV element. Embedding gathers, norms, activations and KV writes are left out,
so the bound stays a bound. A forward takes at least ``max(flops / peak_flops, bytes / peak_bw)``, or, where the
projections run on another arithmetic than the attention (8-bit integer dot products beside fp32 attention),
``max(projection_flops / peak_flops + attention_flops / attention_peak_flops, bytes / peak_bw)``: each part at
the peak of the arithmetic that computes it.

The ideal schedule of a closed batch (``ideal_forwards``) admits every request at once: one forward
prefills every prompt and samples each request's first token, then one decode forward per further
token, rows leaving as they finish. Any real schedule runs at least as many forwards (a request's
tokens come one forward after another) and does the same arithmetic, so its time is at least the sum
of the per-forward bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a tokenmill or Hugging Face Llama config (the usual attribute names)."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o, gate, up, down of one decoder layer."""
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp

    @property
    def matmul_params(self) -> int:
        return self.num_layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size


# SmolLM2-135M-Instruct, the embedded model.
SMOLLM2_135M = ModelShape(576, 1536, 30, 9, 3, 64, 49152)


@dataclass(frozen=True)
class RowWork:
    """One row of a forward: ``num_new_tokens`` computed now, context ``seq_len`` long afterwards."""

    num_new_tokens: int
    seq_len: int
    num_logit_rows: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.num_new_tokens <= self.seq_len:
            raise ValueError(f"need 0 < num_new_tokens <= seq_len, got {self.num_new_tokens}, {self.seq_len}")
        if not 0 <= self.num_logit_rows <= self.num_new_tokens:
            raise ValueError(f"num_logit_rows must be in [0, num_new_tokens], got {self.num_logit_rows}")

    @property
    def num_causal_pairs(self) -> int:
        """(query, key) pairs: the token at position p attends to p + 1 keys, p in [L - n, L)."""
        start, end = self.seq_len - self.num_new_tokens, self.seq_len
        return end * (end + 1) // 2 - start * (start + 1) // 2


@dataclass(frozen=True)
class Cost:
    flops: float = 0.0  # every FLOP, the attention's included
    bytes: float = 0.0
    attention_flops: float = 0.0  # the part of ``flops`` in QK^T and PV

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops, self.bytes + other.bytes, self.attention_flops + other.attention_flops
        )

    def compute_s(self, peak_flops: float, attention_peak_flops: float | None = None) -> float:
        """The projections and the head at ``peak_flops``, the attention at ``attention_peak_flops`` (the same
        peak when it is None)."""
        attention_peak = attention_peak_flops or peak_flops
        return (self.flops - self.attention_flops) / peak_flops + self.attention_flops / attention_peak

    def time_s(self, peak_flops: float, peak_bw: float, attention_peak_flops: float | None = None) -> float:
        return max(self.compute_s(peak_flops, attention_peak_flops), self.bytes / peak_bw)


def forward_cost(
    shape: ModelShape, rows: Sequence[RowWork], weight_bytes: float = 4.0, kv_bytes: float = 4.0
) -> Cost:
    num_tokens = sum(r.num_new_tokens for r in rows)
    num_logit_rows = sum(r.num_logit_rows for r in rows)
    num_pairs = sum(r.num_causal_pairs for r in rows)
    attention_flops = 4 * shape.num_layers * shape.num_heads * shape.head_dim * num_pairs
    flops = 2 * shape.matmul_params * num_tokens + attention_flops + 2 * shape.lm_head_params * num_logit_rows
    weight_params = shape.matmul_params + (shape.lm_head_params if num_logit_rows else 0)
    kv_read = shape.num_layers * 2 * shape.kv_dim * kv_bytes * sum(r.seq_len for r in rows)
    return Cost(float(flops), weight_params * weight_bytes + kv_read, float(attention_flops))


def ideal_forwards(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> list[list[RowWork]]:
    """Every request admitted at once: one prefill forward, then one decode forward per further token."""
    if len(prompt_lens) != len(output_lens):
        raise ValueError("prompt_lens and output_lens differ in length")
    if any(p < 1 for p in prompt_lens) or any(o < 1 for o in output_lens):
        raise ValueError("every prompt and every output needs at least one token")
    forwards = [[RowWork(p, p, 1) for p in prompt_lens]]
    for step in range(1, max(output_lens)):
        # The token sampled at the previous step goes in; context is prompt + step tokens.
        rows = [RowWork(1, p + step, 1) for p, o in zip(prompt_lens, output_lens, strict=True) if o > step]
        forwards.append(rows)
    return forwards


@dataclass(frozen=True)
class Bound:
    time_s: float  # sum over forwards of max(compute, memory)
    compute_s: float  # all FLOPs at their peaks, as if memory were free
    memory_s: float  # all bytes at peak bandwidth, as if arithmetic were free
    flops: float
    bytes: float
    num_forwards: int

    @property
    def limited_by(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def as_dict(self) -> dict[str, object]:
        return {
            "time_s": self.time_s,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "flops": self.flops,
            "bytes": self.bytes,
            "num_forwards": self.num_forwards,
            "limited_by": self.limited_by,
        }


def lower_bound(
    shape: ModelShape,
    forwards: Sequence[Sequence[RowWork]],
    peak_flops: float,
    peak_bw: float,
    weight_bytes: float = 4.0,
    kv_bytes: float = 4.0,
    attention_peak_flops: float | None = None,
) -> Bound:
    """``attention_peak_flops``: the attention's peak where it differs from the projections' ``peak_flops``."""
    time_s = 0.0
    total = Cost()
    for rows in forwards:
        cost = forward_cost(shape, rows, weight_bytes, kv_bytes)
        time_s += cost.time_s(peak_flops, peak_bw, attention_peak_flops)
        total = total + cost
    return Bound(
        time_s=time_s,
        compute_s=total.compute_s(peak_flops, attention_peak_flops),
        memory_s=total.bytes / peak_bw,
        flops=total.flops,
        bytes=total.bytes,
        num_forwards=len(forwards),
    )


def workload_bound(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    peak_flops: float,
    peak_bw: float,
    weight_bytes: float = 4.0,
    kv_bytes: float = 4.0,
    attention_peak_flops: float | None = None,
) -> Bound:
    """The lower bound on a closed batch's time under the ideal schedule."""
    forwards = ideal_forwards(prompt_lens, output_lens)
    return lower_bound(shape, forwards, peak_flops, peak_bw, weight_bytes, kv_bytes, attention_peak_flops)
