"""Prompt lookup (n-gram) proposals for speculative decoding. Pure Python, no torch.

For a decoding request, the longest suffix of prompt + output (``prompt_lookup_max`` tokens down to
``prompt_lookup_min``) that occurred before proposes the tokens that followed its most recent earlier
occurrence, up to ``num_speculative_tokens``: on input-grounded work (editing code in the prompt, quoting a
source) the model often writes exactly that. The target model verifies the proposal in its next forward
(``worker/sampler.py``), so a wrong guess costs compute, never correctness.

Each request's n-grams are indexed as its tokens arrive (a dict from n-gram to its latest start), so a
proposal costs O(prompt_lookup_max) per step, not a scan of the context.

**Back-off**: a proposal that is rejected outright puts the request in a cool-down: after ``m`` such proposals
in a row it makes no proposal for ``2**m`` decode steps (at most 64), and one accepted draft token resets it.
On text where nothing repeats (random tokens) proposals are rare to begin with; where they keep failing, the
request decodes plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import SpeculativeConfig
from tokenmill.request import Request

MAX_COOLDOWN_STEPS = 64


@dataclass
class _Index:
    grams: dict[tuple[int, ...], int] = field(
        default_factory=dict
    )  # n-gram -> start of its latest occurrence
    num_indexed_ends: int = 0  # n-grams ending at positions 0 .. num_indexed_ends - 1 are in ``grams``
    num_misses: int = 0  # proposals in a row with no token accepted
    cooldown_steps: int = 0  # decode steps left without a proposal


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._state: dict[str, _Index] = {}

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_num_tokens)`` tokens to verify after the request's last one
        (empty: nothing matched, or the request is cooling down). A constrained request's proposal is cut at
        the first token its grammar would refuse."""
        limit = min(self.num_speculative_tokens, max_num_tokens)
        state = self._state.setdefault(request.request_id, _Index())
        if limit <= 0:
            return []
        if state.cooldown_steps > 0:
            state.cooldown_steps -= 1
            return []
        tokens = request.all_token_ids
        self._extend_index(state, tokens)
        proposal = self._lookup(state, tokens, limit)
        if proposal and request.grammar is not None:
            proposal = proposal[: request.grammar.validate_tokens(proposal)]
        return proposal

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The verification's outcome for a proposal of ``num_proposed`` tokens."""
        state = self._state.get(request_id)
        if state is None or num_proposed == 0:
            return
        if num_accepted > 0:
            state.num_misses = 0
            return
        state.num_misses += 1
        state.cooldown_steps = min(2**state.num_misses, MAX_COOLDOWN_STEPS)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

    # --- the index --------------------------------------------------------------------------------
    def _extend_index(self, state: _Index, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (the suffix itself is what gets looked up)."""
        grams = state.grams
        for end in range(state.num_indexed_ends, len(tokens) - 1):
            for n in range(self.min_n, self.max_n + 1):
                start = end - n + 1
                if start >= 0:
                    grams[tuple(tokens[start : end + 1])] = start
        state.num_indexed_ends = max(state.num_indexed_ends, len(tokens) - 1)

    def _lookup(self, state: _Index, tokens: list[int], limit: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = state.grams.get(tuple(tokens[length - n :]))
            if start is not None:  # it ended at length - 2 or before: at least one token follows it
                return tokens[start + n : start + n + limit]
        return []
