"""Speculative decoding's proposers: what a decode row verifies after its last token. Pure Python, no torch.

The scheduler asks ``propose(request, max_num_tokens, num_running)`` for each decoding row (nothing comes back
in a step with ``disable_by_batch_size`` running requests or more) and reports each verification's outcome
through ``observe``; ``forget`` drops a finished request's state.

**NgramProposer** (``method="ngram"``, prompt lookup). For a decoding request, the longest suffix of prompt +
output (``prompt_lookup_max`` tokens down to ``prompt_lookup_min``) that occurred before proposes the tokens that followed its most recent earlier
occurrence, up to ``num_speculative_tokens``: on input-grounded work (editing code in the prompt, quoting a
source) the model often writes exactly that. The target model verifies the proposal in its next forward
(``worker/sampler.py``), so a wrong guess costs compute, never correctness.

Each request's n-grams are indexed as its tokens arrive (a dict from n-gram to its latest start), so a
proposal costs O(prompt_lookup_max) per step, not a scan of the context.

**Back-off**: a proposal of which less than half is accepted puts the request in a cool-down: after ``m`` such
proposals in a row it makes no proposal for ``2**m`` decode steps (at most 64), and a proposal at least half
accepted resets it. Half is where verifying breaks even on a CPU's exact fp32 path: on 2 Zen 4 cores a 1.5B
forward of 5 tokens costs 2.0 plain decode steps (as decode rows in the decode stack; 3 tokens 1.5), so 4 proposed
tokens must yield 2 accepted ones plus the target's own to gain (with 8-bit activations, gguf-q8, 5 tokens cost
1.1 steps).
On text where nothing repeats (random tokens) proposals are rare to begin with; where they keep failing, the
request decodes plainly.

**DraftSlots** (``method="draft_model"``): the scheduler cannot know a draft model's tokens, so it gives the row
``num_speculative_tokens`` slots holding :data:`DRAFT_PLACEHOLDER`; the runner's drafter (``worker/drafter.py``)
runs the draft model and writes its tokens into them before the target's forward, stopping at a token it gives
less than ``draft_p_min``. Same back-off, where two proposals in a row left empty (the draft unsure of its first
token: its forward spent, nothing to verify) count as one rejected proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import SpeculativeConfig
from tokenmill.request import Request

MAX_COOLDOWN_STEPS = 64
EMPTY_DRAFTS_PER_MISS = 2  # a draft model's empty proposals in a row that count as one rejected proposal
DRAFT_PLACEHOLDER = -1  # a slot the drafter fills (never a token id the target sees)


@dataclass
class _State:
    num_misses: int = 0  # proposals in a row with less than half of their tokens accepted
    num_empty_drafts: int = 0  # a draft model's empty proposals since the last miss or good proposal
    cooldown_steps: int = 0  # decode steps left without a proposal
    grams: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> its latest occurrence's start
    num_indexed_ends: int = 0  # n-grams ending at positions 0 .. num_indexed_ends - 1 are in ``grams``
    num_plain_steps: int = 0  # decode steps without proposals because the batch was too wide
    num_proposals: int = 0


class Proposer:
    """The back-off and the per-request state both proposers keep."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self._state: dict[str, _State] = {}

    def propose(self, request: Request, max_num_tokens: int, num_running: int = 1) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_num_tokens)`` tokens to verify after the request's last one
        (empty: nothing to propose, the batch of ``num_running`` is too wide, or the request is cooling down)."""
        limit = min(self.num_speculative_tokens, max_num_tokens)
        state = self._state.setdefault(request.request_id, _State())
        if self.disable_by_batch_size and num_running >= self.disable_by_batch_size:
            state.num_plain_steps += 1
            return []  # a batch this wide is past memory-bound: verifying would cost more than it saves
        if limit <= 0:
            return []
        if state.cooldown_steps > 0:
            state.cooldown_steps -= 1
            return []
        return self._propose(state, request, limit)

    def _propose(self, state: _State, request: Request, limit: int) -> list[int]:
        raise NotImplementedError

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The verification's outcome for a proposal of ``num_proposed`` tokens (0: a draft model's slots that
        it left empty, unsure of its first token)."""
        state = self._state.get(request_id)
        if state is None:
            return
        if num_proposed == 0:
            state.num_empty_drafts += 1
            if state.num_empty_drafts < EMPTY_DRAFTS_PER_MISS:
                return
        elif 2 * num_accepted >= num_proposed:  # at least half accepted: the verification paid for itself
            state.num_misses = state.num_empty_drafts = 0
            return
        state.num_empty_drafts = 0
        state.num_misses += 1
        state.cooldown_steps = min(2**state.num_misses, MAX_COOLDOWN_STEPS)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


class DraftSlots(Proposer):
    """``num_speculative_tokens`` placeholder slots for the drafter to fill.

    A request that has not drafted yet and decoded plainly first (its batch was too wide) starts drafting only
    while the tokens it may still generate are at least those the draft would first have to read (its whole
    context): on 2 Zen 4 cores, 8 concurrent code edits ran 0.87x when the draft caught up on every request's
    prompt as the batch thinned out."""

    def _propose(self, state: _State, request: Request, limit: int) -> list[int]:
        if state.num_proposals == 0 and state.num_plain_steps > 0:
            remaining = request.sampling_params.max_tokens - request.num_output_tokens
            if remaining < request.num_tokens:
                return []
        state.num_proposals += 1
        return [DRAFT_PLACEHOLDER] * limit


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def _propose(self, state: _State, request: Request, limit: int) -> list[int]:
        """A constrained request's proposal is cut at the first token its grammar would refuse."""
        proposal = self._find(state, request.all_token_ids, limit)
        if proposal and request.grammar is not None:
            proposal = proposal[: request.grammar.validate_tokens(proposal)]
        return proposal

    def lookup(self, key: str, tokens: list[int], limit: int) -> list[int]:
        """The proposal for a context of ``tokens`` alone (no back-off, no grammar), its index kept under ``key``
        while the context grows: what ``benchmarks/spec.py`` replays plain decoding's outputs through."""
        return self._find(self._state.setdefault(key, _State()), tokens, limit)

    def _find(self, state: _State, tokens: list[int], limit: int) -> list[int]:
        self._extend_index(state, tokens)
        return self._lookup(state, tokens, limit)

    # --- the index --------------------------------------------------------------------------------
    def _extend_index(self, state: _State, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (the suffix itself is what gets looked up)."""
        grams = state.grams
        for end in range(state.num_indexed_ends, len(tokens) - 1):
            for n in range(self.min_n, self.max_n + 1):
                start = end - n + 1
                if start >= 0:
                    grams[tuple(tokens[start : end + 1])] = start
        state.num_indexed_ends = max(state.num_indexed_ends, len(tokens) - 1)

    def _lookup(self, state: _State, tokens: list[int], limit: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = state.grams.get(tuple(tokens[length - n :]))
            if start is not None:  # it ended at length - 2 or before: at least one token follows it
                return tokens[start + n : start + n + limit]
        return []
