"""Engine-wide counters built from the per-step records (the seed's occupancy and its reasons). Pure Python."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from tokenmill.core.sched_output import IdleReason, StepRecord


@dataclass
class EngineStats:
    """Totals over every iteration that computed at least one row.

    ``num_token_slots`` counts row-iterations (a prefill row counts once, however long its prompt), the
    seed's unit: the seed workload computes 60 token-slots to collect 60 tokens.
    ``occupancy = num_token_slots / (num_rows_possible * num_iterations)``: how full the batch was.
    """

    num_iterations: int = 0
    num_token_slots: int = 0
    num_rows_possible: int = 0  # summed over iterations
    num_collected_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_finished: int = 0
    num_prefix_queried_tokens: int = 0  # prompt (+ output, after a preemption) tokens looked up at admission
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache: not computed
    num_prefix_evicted_blocks: int = 0  # cached blocks reused for other tokens (set by the engine)
    num_failed_steps: int = 0  # forwards that raised (their requests ended with an error)
    idle_rows_by_reason: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in IdleReason})
    records: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=100_000))

    @property
    def occupancy(self) -> float:
        return self.num_token_slots / self.num_rows_possible if self.num_rows_possible else 0.0

    @property
    def num_idle_rows(self) -> int:
        return sum(self.idle_rows_by_reason.values())

    def idle_share_by_reason(self) -> dict[str, float]:
        """Each reason's share of idle row-iterations (sums to 1 when any row was idle)."""
        total = self.num_idle_rows
        return {k: (v / total if total else 0.0) for k, v in self.idle_rows_by_reason.items()}

    def totals(self) -> EngineStats:
        """A copy of the counters without the per-step records, safe to hand to another thread."""
        return replace(self, idle_rows_by_reason=dict(self.idle_rows_by_reason), records=deque(maxlen=1))

    def add_step(self, record: StepRecord, num_new_tokens: int) -> None:
        self.num_preemptions += record.num_preemptions
        self.num_collected_tokens += num_new_tokens
        if record.batch_size == 0:
            return
        self.records.append(record)
        self.num_iterations += 1
        self.num_token_slots += record.batch_size
        self.num_rows_possible += record.num_rows_possible
        self.num_prefill_tokens += record.num_prefill_tokens
        self.num_decode_tokens += record.num_decode_tokens
        self.num_recomputed_tokens += record.num_recomputed_tokens
        self.num_prefix_queried_tokens += record.num_prefix_queried_tokens
        self.num_prefix_hit_tokens += record.num_prefix_hit_tokens
        for reason, n in record.idle_rows.items():
            self.idle_rows_by_reason[reason.value] += n

    def as_dict(self) -> dict[str, object]:
        names = (
            "num_iterations num_token_slots num_collected_tokens occupancy num_prefill_tokens num_decode_tokens"
            " num_preemptions num_recomputed_tokens num_prefix_queried_tokens num_prefix_hit_tokens"
            " num_prefix_evicted_blocks num_finished num_failed_steps"
        )
        return {
            **{name: getattr(self, name) for name in names.split()},
            "idle_rows_by_reason": dict(self.idle_rows_by_reason),
        }
