"""The one contract between the scheduler and the model runner. Pure Python, no torch.

Each engine step:

1. ``Scheduler.schedule()`` returns a :class:`SchedulerOutput`: the rows of this iteration's flat batch, in
   order, each with the tokens to compute now and the block table their keys and values live in (blocks for
   every new token are already allocated). It is plain data (ids, token ids, positions, block ids: no live
   request), so it pickles as it is: tensor parallelism broadcasts its rows to the worker ranks.
2. ``ModelRunner.execute(scheduler_output)`` builds tensors from it, runs the model, samples one token for
   each row with ``sample=True`` (reading each request's sampling state from the engine's request table, by
   id) and returns a :class:`ModelRunnerOutput`.
   A row with ``num_spec_tokens`` k > 0 (speculative decoding) carries the last sampled token and k proposed
   ones; the runner samples at all k + 1 positions, keeps the proposed tokens while the target agrees (or, when
   sampling, while rejection sampling accepts them) and returns them and the target's next token. A draft
   model's slots (method ``draft_model``) may hold fewer tokens than the scheduler gave (the draft stopped at
   a token it was unsure of): the runner says how many in ``num_drafted``, 0 meaning a plain decode row.
3. ``Scheduler.update_from_output(scheduler_output, runner_output, now_s)`` appends the sampled tokens,
   advances ``num_computed_tokens`` (past the accepted tokens only: a rejected
   token's slot is given back), finishes requests (freeing their blocks at once: the forward that
   read them is over) and returns the requests touched this step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class IdleReason(enum.Enum):
    """Why a row that could have run (one of ``max_num_seqs``) did not compute a token this step."""

    QUEUE_EMPTY = "queue_empty"  # nobody waiting to be admitted
    KV_POOL_FULL = "kv_pool_full"  # a waiting request did not fit in the free blocks
    KV_RESERVED = "kv_reserved"  # it would fit if worst-case reservations did not hold unused blocks
    TOKEN_BUDGET = "token_budget"  # max_num_batched_tokens spent
    PREEMPTED = "preempted"  # admission paused because this step preempted
    MAX_NUM_SEQS = "max_num_seqs"  # rows beyond max_num_seqs that a wider batch would have filled
    LORA_SLOTS = "lora_slots"  # every waiting request's LoRA adapter would be one past max_loras


@dataclass
class ScheduledRow:
    """One row of the flat batch: ``token_ids`` at positions ``start_position ..`` of request ``request_id``."""

    request_id: str
    token_ids: list[int]  # the tokens computed now (a prompt chunk, a re-prefill, or the last sampled token)
    start_position: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # the request's whole block table, covering start_position + len(token_ids)
    sample: bool  # True when this row's last token is the sequence's last: a new token is wanted
    is_prefill: bool  # True while computing prompt (or recomputed) tokens
    # Speculative decoding: the last token_ids are this many proposed tokens to verify (the row samples at
    # each of its 1 + num_spec_tokens positions; ModelRunnerOutput.verified holds what was kept)
    num_spec_tokens: int = 0
    lora_id: int = 0  # the request's LoRA adapter (LoRARequest.lora_int_id; 0: the base model)

    @property
    def spec_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens :]

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: keys/values the row's last token attends to."""
        return self.start_position + len(self.token_ids)


@dataclass
class StepRecord:
    """What one iteration did, for stats and benchmarks (the seed's per-iteration record)."""

    batch_size: int = 0  # rows computed
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_rows_possible: int = 0  # max_num_seqs
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again because of a preemption
    num_prefix_queried_tokens: int = 0  # tokens of admitted requests looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # of those, served from it (not computed)
    idle_rows: dict[IdleReason, int] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    admitted_ids: list[str] = field(default_factory=list)
    # speculative decoding (filled in by update_from_output): rows with a proposal, tokens proposed, accepted,
    # accepted at each proposal position; the rejected tokens' slots (computed, thrown away) are the waste
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def num_spec_rejected_tokens(self) -> int:
        return self.num_spec_draft_tokens - self.num_spec_accepted_tokens


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    record: StepRecord
    finished_ids: list[str] = field(default_factory=list)  # ended during scheduling (preemption bound)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


@dataclass
class SampledToken:
    """The runner's answer for one row with ``sample=True``."""

    token_id: int
    logprob: float | None = None  # the sampled token's log-probability (raw model distribution)
    top_logprobs: list[tuple[int, float]] | None = None  # (token_id, logprob), best first, k of them


@dataclass
class ModelRunnerOutput:
    # request_id -> sampled token, for rows with sample=True and no proposal
    sampled: dict[str, SampledToken]
    # request_id -> for rows with a proposal (num_spec_tokens > 0): the accepted proposed tokens, then the one
    # the target chose after them (1 .. num_spec_tokens + 1 tokens)
    verified: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request_id -> the tokens a draft row's drafter proposed, where fewer than its num_spec_tokens slots (its
    # verified tokens then number 1 .. that + 1; 0: the row was decoded plainly, its token in ``sampled``)
    num_drafted: dict[str, int] = field(default_factory=dict)
    # request_id -> per prompt token [(token_id, logprob, top-k list)], only for requests that asked
    prompt_logprobs: dict[str, list[Any]] = field(default_factory=dict)
    # request_id -> the pooled embedding of a prompt an encoder computed whole (embedding models only)
    pooled: dict[str, list[float]] = field(default_factory=dict)
