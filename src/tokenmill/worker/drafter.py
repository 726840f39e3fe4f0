"""The draft model of speculative decoding (``speculative_config={"method": "draft_model", "model": ...}``).

The scheduler gives a drafting decode row ``k`` placeholder slots (``core/proposers.py``: ``DraftSlots``) and
blocks for all 1 + k of its tokens. Before the target's forward, :meth:`Drafter.fill` writes the draft model's
greedy tokens into them: one draft forward over every drafting row's tokens the draft has not seen yet (the
whole prompt the first time; afterwards the last one or two), then up to ``k - 1`` forwards of one token per
row. A row's drafting ends early at a token the draft itself gives less than ``p_min`` (``draft_p_min``,
llama.cpp's ``--draft-p-min``): its proposal is then shorter than its slots (``num_spec_tokens`` cut to it;
none: the row decodes plainly) and the runner tells the scheduler so (``ModelRunnerOutput.num_drafted``).
Greedy drafts and where they end are a deterministic function of the context, a point mass, so the sampler's
verification keeps the target's distribution exact for sampled requests too. For the same reason the draft needs
no exact arithmetic: the engine loads a quantized GGUF draft on CPU with ``quantization="gguf-q4"`` (its
projections rounded to 4 bits, 8-bit activations: the fewest bytes a draft token reads), unless
``speculative_config.quantization`` names another.

The draft's KV lives in its own tensors, indexed by the target's block table: the draft writes the same slots
the target writes for those positions (the row's own blocks, allocated this step), so its blocks are allocated
and freed with the request's. A request's draft KV is valid up to the row's last sampled token and then for as
long as the draft's own inputs after it (drafts 1 .. k - 1) match the tokens the request went on to have: the
next fill, however many plain steps later (back-off, a wide batch), reads that from the request's tokens and
computes the draft again from the first position that differs. After a preemption none of it is valid. A
prompt whose prefix came from the prefix cache is drafted over whole the first time (the cached blocks' draft
KV was written by whichever request computed them, if it drafted at all), writing values equal to any already
there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from tokenmill.core.sched_output import ScheduledRow
from tokenmill.model.loader import LoadedModel, allocate_kv_cache
from tokenmill.request import Request
from tokenmill.worker.forward import forward_rows


@dataclass
class _Progress:
    num_valid: int = 0  # positions whose draft KV is right whatever the target kept
    inputs: list[int] = field(default_factory=list)  # its inputs at positions num_valid.. (its drafts)
    num_preemptions: int = 0  # the request's count when num_valid was set

    def valid_for(self, token_ids: list[int]) -> int:
        """Positions whose draft KV is right for a request now holding ``token_ids``: ``num_valid`` plus the
        draft inputs after it that the request's tokens agree with (the drafts the target accepted)."""
        num_valid = self.num_valid
        for token in self.inputs:
            if num_valid >= len(token_ids) or token_ids[num_valid] != token:
                break
            num_valid += 1
        return num_valid


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """ValueError unless the draft tokenizes as the target does (same ids for the same token strings)."""
    t, d = target.tokenizer, draft.tokenizer
    problems = []
    if t.vocab_size != d.vocab_size:
        problems.append(f"{t.vocab_size} vs {d.vocab_size} tokens")
    elif any(t.id_to_token(i) != d.id_to_token(i) for i in range(t.vocab_size)):
        problems.append("the same ids name different tokens")
    if draft.config.vocab_size < target.config.vocab_size:
        problems.append(
            f"the draft's output layer has {draft.config.vocab_size} rows, the target's {target.config.vocab_size}"
        )
    if problems:
        raise ValueError(
            f"speculative_config.model {draft.source!r}: its vocabulary differs from the target's ({'; '.join(problems)})"
        )


class Drafter:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        requests: Mapping[str, Request],
        p_min: float,
    ) -> None:
        self.loaded = loaded
        self.p_min = p_min
        self.block_size = block_size
        self.requests = requests
        self.kv_caches = allocate_kv_cache(loaded.config, num_blocks, block_size, loaded.dtype, loaded.device)
        self._progress: dict[str, _Progress] = {}

    def fill(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """The rows with their placeholder slots holding the draft's tokens, fewer where the draft's confidence
        fell below ``p_min`` (``num_spec_tokens`` cut to them); other rows as they are."""
        drafting = [i for i, row in enumerate(rows) if row.num_spec_tokens]
        for rid in [r for r in self._progress if r not in self.requests]:
            del self._progress[rid]  # finished
        if not drafting:
            return rows
        wanted = {rows[i].request_id: rows[i].num_spec_tokens for i in drafting}
        drafts = self._draft([self._catch_up(rows[i]) for i in drafting], wanted)
        out = list(rows)
        for i in drafting:
            row = rows[i]
            k, drafted = row.num_spec_tokens, drafts[row.request_id]
            out[i] = replace(
                row,
                token_ids=[*row.token_ids[: len(row.token_ids) - k], *drafted],
                num_spec_tokens=len(drafted),
            )
            # the draft's inputs were the last sampled token (right) and each draft it drafted after (all of
            # them when it stopped short, the first k - 1 otherwise): right as far as the target accepts them
            progress = self._progress[row.request_id]
            progress.num_valid, progress.inputs = row.start_position + 1, drafted[: k - 1]
        return out

    def _catch_up(self, row: ScheduledRow) -> ScheduledRow:
        """The draft's first forward for ``row``: what it has not seen, up to and including the row's last sampled
        token. After a verification the draft's KV is right up to the target's accepted length (the row's start)
        at most."""
        request = self.requests[row.request_id]
        progress = self._progress.setdefault(row.request_id, _Progress())
        if progress.num_preemptions != request.num_preemptions:  # its blocks were dropped and computed anew
            progress.num_valid, progress.num_preemptions = 0, request.num_preemptions
        start = min(progress.valid_for(request.all_token_ids), row.start_position)
        tokens = request.all_token_ids[start : row.start_position + 1]
        is_prefill = start < request.num_prompt_tokens  # the prompt's tokens: a prefill's attention
        return ScheduledRow(row.request_id, tokens, start, row.block_ids, True, is_prefill)

    def _draft(self, current: list[ScheduledRow], wanted: dict[str, int]) -> dict[str, list[int]]:
        """Greedy drafts, a forward a token, each row's until it has ``wanted`` of them or the draft's confidence
        falls below ``p_min``."""
        drafts: dict[str, list[int]] = {rid: [] for rid in wanted}
        device = self.loaded.device
        while current:
            hidden = forward_rows(self.loaded.model, current, self.kv_caches, self.block_size, device)
            last = torch.tensor(list(accumulate(r.num_new_tokens for r in current)), device=device) - 1
            logits = self.loaded.model.compute_logits(hidden[last])  # [rows, V]
            confidence, best = torch.softmax(logits.float(), dim=-1).max(dim=-1)  # the greedy drafts
            following = []
            for row, token, p in zip(current, best.tolist(), confidence.tolist(), strict=True):
                if p < self.p_min:
                    continue  # the row's proposal ends before this token
                drafted = drafts[row.request_id]
                drafted.append(int(token))
                if len(drafted) < wanted[row.request_id]:  # the next forward's input
                    following.append(
                        ScheduledRow(row.request_id, [int(token)], row.seq_len, row.block_ids, True, False)
                    )
            current = following
        return drafts
