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
    # the prefix cache's disk tier (set by the engine from worker/kv_offload.py): tokens asked of it past the memory
    # tier and read back from it; blocks written, evicted by its bound, refused as corrupt, not written
    num_disk_queried_tokens: int = 0
    num_disk_hit_tokens: int = 0
    num_disk_stored_blocks: int = 0
    num_disk_evicted_blocks: int = 0
    num_disk_corrupt_blocks: int = 0
    num_disk_failed_writes: int = 0
    num_failed_steps: int = 0  # forwards that raised (their requests ended with an error)
    # speculative decoding: verifications (rows with a proposal), tokens proposed, tokens accepted, and accepted
    # at each proposal position (vLLM's spec_decode counters); rejected tokens' slots were computed for nothing
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    idle_rows_by_reason: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in IdleReason})
    # the roofline (tokenmill.measure.roofline, when the engine knows its machine's limits), by step kind: the steps'
    # least possible time on this machine, their wall time, and how many
    roofline_bound_s: dict[str, float] = field(default_factory=dict)
    roofline_step_s: dict[str, float] = field(default_factory=dict)
    num_roofline_steps: dict[str, int] = field(default_factory=dict)
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

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted proposed tokens / proposed tokens."""
        return (
            self.num_spec_accepted_tokens / self.num_spec_draft_tokens if self.num_spec_draft_tokens else 0.0
        )

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verification row yields on average: 1 (the target's own) + the accepted proposed ones."""
        return 1.0 + self.num_spec_accepted_tokens / self.num_spec_drafts if self.num_spec_drafts else 0.0

    @property
    def spec_waste_fraction(self) -> float:
        """Decode token positions computed for proposed tokens that were rejected, over all decode positions."""
        rejected = self.num_spec_draft_tokens - self.num_spec_accepted_tokens
        return rejected / self.num_decode_tokens if self.num_decode_tokens else 0.0

    def add_roofline(self, kind: str, bound_s: float, step_s: float) -> None:
        self.roofline_bound_s[kind] = self.roofline_bound_s.get(kind, 0.0) + bound_s
        self.roofline_step_s[kind] = self.roofline_step_s.get(kind, 0.0) + step_s
        self.num_roofline_steps[kind] = self.num_roofline_steps.get(kind, 0) + 1

    @property
    def roofline_fraction_by_kind(self) -> dict[str, float]:
        """Per step kind: the least possible time of its steps over their wall time (1 = the machine's limit)."""
        return {k: self.roofline_bound_s[k] / t for k, t in self.roofline_step_s.items() if t > 0}

    def totals(self) -> EngineStats:
        """A copy of the counters without the per-step records, safe to hand to another thread."""
        return replace(
            self,
            idle_rows_by_reason=dict(self.idle_rows_by_reason),
            spec_accepted_per_pos=list(self.spec_accepted_per_pos),
            roofline_bound_s=dict(self.roofline_bound_s),
            roofline_step_s=dict(self.roofline_step_s),
            num_roofline_steps=dict(self.num_roofline_steps),
            records=deque(maxlen=1),
        )

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
        if record.num_spec_drafts:
            self.num_spec_drafts += record.num_spec_drafts
            self.num_spec_draft_tokens += record.num_spec_draft_tokens
            self.num_spec_accepted_tokens += record.num_spec_accepted_tokens
            per_pos = self.spec_accepted_per_pos
            per_pos.extend([0] * (len(record.spec_accepted_per_pos) - len(per_pos)))
            for i, n in enumerate(record.spec_accepted_per_pos):
                per_pos[i] += n

    def as_dict(self) -> dict[str, object]:
        names = (
            "num_iterations num_token_slots num_collected_tokens occupancy num_prefill_tokens num_decode_tokens"
            " num_preemptions num_recomputed_tokens num_prefix_queried_tokens num_prefix_hit_tokens"
            " num_prefix_evicted_blocks num_finished num_failed_steps num_spec_drafts num_spec_draft_tokens"
            " num_spec_accepted_tokens spec_acceptance_rate spec_mean_acceptance_length spec_waste_fraction"
        )
        return {
            **{name: getattr(self, name) for name in names.split()},
            "spec_accepted_per_pos": list(self.spec_accepted_per_pos),
            "idle_rows_by_reason": dict(self.idle_rows_by_reason),
            "roofline_fraction_by_kind": self.roofline_fraction_by_kind,
            "num_roofline_steps": dict(self.num_roofline_steps),
        }
