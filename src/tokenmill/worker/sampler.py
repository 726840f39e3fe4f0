"""Logits -> one token per row, vectorized across the batch.

Per row, in order (each step touches only the rows that asked for it)::

    raw logits ──┬─> log_softmax ──> logprobs of the sampled token and the top k   (raw distribution)
                 └─> repetition / frequency / presence penalties
                     -> logit_bias -> min_tokens (EOS and stop tokens masked)
                     -> the grammar's allowed tokens (constrained rows only: structured_outputs)
                     -> temperature 0: argmax
                        otherwise:   / temperature -> top_k -> top_p -> min_p -> a draw (inverse CDF)
                                     (a row with top_k <= 1024: over its top_k candidates only)

A row draws from ``p`` exactly by inverse CDF: one uniform against the cumulative sum (speculative decoding's
rejection sampling uses the exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``). A seeded row's uniform
comes from a generator seeded with ``mix(seed, num_output_tokens)``: stateless, so the same token comes out
whatever else is in the batch, and again after a preemption recomputes the request. Unseeded rows share one
engine-wide generator, drawn in one call.

:meth:`Sampler.verify` is speculative decoding's: the same processing at each position of a row's proposal, then
greedy acceptance or rejection sampling (exact in distribution).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tokenmill.core.sched_output import SampledToken
from tokenmill.outputs import Logprob
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_outputs import apply_masks, apply_masks_along

# Below this temperature a row is greedy: dividing by it would overflow float32 for no visible difference.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1
# A sampled row with top_k up to this draws among its top_k candidates (a topk), not over the vocabulary (a sort).
_MAX_CANDIDATES = 1024


class _RowState(Protocol):
    """What the logit processors read of a request (a :class:`Request`, or one position of a proposal)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...


class _Position:
    """A request as it would stand after accepting the first ``len(extra)`` proposed tokens."""

    __slots__ = ("_request", "_extra")

    def __init__(self, request: Request, extra: list[int]) -> None:
        self._request = request
        self._extra = extra

    @property
    def sampling_params(self) -> SamplingParams:
        return self._request.sampling_params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._request.output_token_ids + self._extra

    @property
    def num_output_tokens(self) -> int:
        return self._request.num_output_tokens + len(self._extra)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._request.eos_token_ids


class Sampler:
    """Chooses the next token of each row. Holds only the engine-wide random generator(s)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # unseeded rows, one per device
        self._per_row: dict[torch.device, torch.Generator] = {}  # re-seeded for every seeded row

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """``logits`` (num_rows, vocab), row i for ``requests[i]``; returns one SampledToken per row, in order."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise RuntimeError(f"sampler got logits {tuple(logits.shape)} for {len(requests)} requests")
        if not requests:
            return []
        params = [r.sampling_params for r in requests]
        # The edits below work in place on a copy; a batch with none of them (greedy rows, no penalties, bias,
        # min_tokens or grammar) chooses from the logits themselves: the copy was 12 MB a step at 64 rows.
        edited = any(
            p.needs_penalties or p.logit_bias or r.num_output_tokens < p.min_tokens or r.grammar is not None
            for p, r in zip(params, requests, strict=True)
        )
        processed = logits.float().clone() if edited else logits.float()  # (B, V)
        _apply_penalties(processed, requests)
        _apply_logit_bias(processed, params)
        _apply_min_tokens(processed, requests)
        apply_masks(processed, [(i, r.grammar) for i, r in enumerate(requests) if r.grammar is not None])
        token_ids = self._choose(processed, requests)  # (B,)
        return _package(logits, token_ids, params)

    def verify(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
    ) -> list[list[SampledToken]]:
        """Speculative decoding's verification. ``logits`` [sum(len(d) + 1), V]: request i's ``len(drafts[i]) + 1``
        positions in order, position j predicting the token after the first j proposed ones. Returns, per
        request, the accepted proposed tokens and then the target's own (1 .. len(d) + 1 tokens).

        Each position's logits go through the same processing as :meth:`__call__`'s, with the state after the
        proposed tokens before it (penalties count them, min_tokens counts them, the grammar has consumed them).
        Greedy rows keep a proposed token while it is the argmax. Sampled rows use rejection sampling with the
        proposal as a point mass (Leviathan et al. 2023; Chen et al. 2023): keep proposed token x with
        probability p(x), else draw from p with x removed; all kept: draw the next from the last position's p.
        Every emitted token is then distributed exactly as the target's own sampling would draw it."""
        offsets = [0]
        views: list[_RowState] = []
        for request, draft in zip(requests, drafts, strict=True):
            views.extend(_Position(request, draft[:j]) for j in range(len(draft) + 1))
            offsets.append(offsets[-1] + len(draft) + 1)
        if logits.dim() != 2 or logits.shape[0] != offsets[-1]:
            raise RuntimeError(f"verify got logits {tuple(logits.shape)} for {offsets[-1]} positions")
        params = [v.sampling_params for v in views]
        processed = logits.float().clone()  # (N, V)
        _apply_penalties(processed, views)
        _apply_logit_bias(processed, params)
        _apply_min_tokens(processed, views)
        for i, request in enumerate(requests):
            if request.grammar is not None:
                apply_masks_along(processed[offsets[i] : offsets[i + 1]], request.grammar, drafts[i])
        greedy = processed.argmax(dim=-1).tolist()  # (N,)
        sampled_rows, sampled_probs = self._probabilities(processed, params)
        probs = dict(
            zip(sampled_rows, sampled_probs, strict=True)
        )  # row -> (V,), the sampled rows' positions
        emitted: list[list[int]] = []
        for i, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
            first = offsets[i]
            if request.sampling_params.temperature < _MIN_TEMPERATURE:
                num_accepted = 0
                while num_accepted < len(draft) and draft[num_accepted] == greedy[first + num_accepted]:
                    num_accepted += 1
                emitted.append([*draft[:num_accepted], greedy[first + num_accepted]])
            else:
                emitted.append(
                    self._rejection_sample(request, draft, [probs[first + j] for j in range(len(draft) + 1)])
                )
        return self._package_verified(logits, requests, offsets, emitted)

    def _probabilities(
        self, processed: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], torch.Tensor]:
        """The sampled rows (temperature > 0) and their distributions (S, V) after temperature, top_k, top_p and
        min_p: what ``_choose`` draws from and ``verify`` accepts against."""
        rows = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
        if not rows:
            return rows, processed.new_empty((0, processed.shape[1]))
        row_index = torch.tensor(rows, device=processed.device)
        temperature = torch.tensor([params[i].temperature for i in rows], device=processed.device)
        x = processed.index_select(0, row_index).div_(temperature.unsqueeze(1))  # (S, V)
        return rows, torch.softmax(_truncate(x, [params[i] for i in rows]), dim=-1)

    def _rejection_sample(self, request: Request, draft: list[int], probs: list[torch.Tensor]) -> list[int]:
        out: list[int] = []
        for j, token in enumerate(draft):
            generator = self._position_generator(request, j, probs[j].device)
            u = torch.rand((), generator=generator, device=probs[j].device).item()
            if u < probs[j][token].item():
                out.append(token)
                continue
            residual = probs[j].clone()
            residual[token] = 0.0
            out.append(_race(residual, generator))
            return out
        generator = self._position_generator(request, len(draft), probs[-1].device)
        out.append(_race(probs[-1], generator))
        return out

    def _position_generator(self, request: Request, j: int, device: torch.device) -> torch.Generator:
        """The generator for output position ``num_output_tokens + j``: seeded per position for a seeded request
        (stateless, as in ``_draw``), else the engine-wide one."""
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared_generator(device)
        generator = self._per_row.get(device)
        if generator is None:
            generator = self._per_row[device] = torch.Generator(device)
        generator.manual_seed(_mix_seed(seed, request.num_output_tokens + j))
        return generator

    def _package_verified(
        self, raw_logits: torch.Tensor, requests: list[Request], offsets: list[int], emitted: list[list[int]]
    ) -> list[list[SampledToken]]:
        out = [[SampledToken(token_id=t) for t in tokens] for tokens in emitted]
        wanted = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not wanted:
            return out
        rows = [offsets[i] + j for i in wanted for j in range(len(emitted[i]))]
        targets = [t for i in wanted for t in emitted[i]]
        device = raw_logits.device
        max_k = max(requests[i].sampling_params.logprobs or 0 for i in wanted)
        chosen, top = _logprobs(
            raw_logits.index_select(0, torch.tensor(rows, device=device)),
            torch.tensor(targets, device=device),
            max_k,
        )
        n = 0
        for i in wanted:
            k = requests[i].sampling_params.logprobs or 0
            for token in out[i]:
                token.logprob, token.top_logprobs = chosen[n], top[n][:k]
                n += 1
        return out

    # --- choosing -----------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)  # (B,): the answer for greedy rows
        params = [r.sampling_params for r in requests]
        vocab = logits.shape[1]
        sampled = [i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE]
        # A row whose top_k is small draws among its top_k candidates only (the rest have probability 0 anyway):
        # one topk instead of a sort and a softmax over the whole vocabulary. The choice is per row, so a
        # seeded row samples the same token whatever else is in the batch.
        narrow = [i for i in sampled if 0 < params[i].top_k <= _MAX_CANDIDATES and params[i].top_k < vocab]
        wide = [i for i in sampled if not 0 < params[i].top_k <= _MAX_CANDIDATES or params[i].top_k >= vocab]
        if wide:
            index = torch.tensor(wide, device=logits.device)
            _, probs = self._probabilities(logits.index_select(0, index), [params[i] for i in wide])  # (W, V)
            token_ids[index] = self._draw(probs, [requests[i] for i in wide])
        if narrow:
            token_ids[torch.tensor(narrow, device=logits.device)] = self._choose_among_top_k(
                logits, [requests[i] for i in narrow], narrow
            )
        return token_ids

    def _choose_among_top_k(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int]
    ) -> torch.Tensor:
        """The sampled token of each of ``rows`` (all with 0 < top_k <= _MAX_CANDIDATES), drawn among its top_k."""
        params = [r.sampling_params for r in requests]
        device = logits.device
        ks = [p.top_k for p in params]
        values, candidates = logits.index_select(0, torch.tensor(rows, device=device)).topk(
            max(ks), dim=-1
        )  # (S, K)
        temperature = torch.tensor([p.temperature for p in params], device=device)
        masked = _mask_sorted(values.div_(temperature.unsqueeze(1)), params)  # (S, K), best first
        choice = self._draw(torch.softmax(masked, dim=-1), requests)  # (S,)
        return candidates.gather(1, choice.unsqueeze(1)).squeeze(1)

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One index per row of ``probs`` (S, N), drawn from it by inverse CDF: one uniform per row against the
        row's cumulative sum (an exponential race needs N draws per row: 13 ms a step at 16 rows of 49k). A
        seeded row's uniform comes from its own generator (``mix(seed, num_output_tokens)``), so its token does not
        depend on the batch; unseeded rows share the engine's."""
        device = probs.device
        u = torch.empty((probs.shape[0], 1), dtype=torch.float32, device=device)  # (S, 1)
        unseeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            draws = torch.empty((len(unseeded), 1), dtype=torch.float32, device=device)
            u[torch.tensor(unseeded, device=device)] = draws.uniform_(
                generator=self._shared_generator(device)
            )
        if len(unseeded) < len(requests):
            generator = self._per_row.get(device)
            if generator is None:
                generator = self._per_row[device] = torch.Generator(device)
            for j, r in enumerate(requests):
                seed = r.sampling_params.seed
                if seed is not None:
                    generator.manual_seed(_mix_seed(seed, r.num_output_tokens))
                    u[j].uniform_(generator=generator)
        cdf = probs.cumsum(dim=-1)  # (S, N)
        # 1 - u is in (0, 1]: the target is above 0, so the first index reaching it has probability > 0
        target = (1.0 - u) * cdf[:, -1:]
        return torch.searchsorted(cdf, target).squeeze(1).clamp_max_(probs.shape[1] - 1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared.get(device)
        if generator is None:
            generator = torch.Generator(device)
            generator.manual_seed(self.seed)
            self._shared[device] = generator
        return generator


def _race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (V,), unnormalised: the exponential race, argmax(p / E)."""
    noise = (
        torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    )
    return int((probs / noise).argmax().item())


# --- logit processing (in place on the (B, V) float32 copy) -------------------------------------
def _apply_penalties(logits: torch.Tensor, requests: Sequence[_RowState]) -> None:
    """Repetition penalty over prompt + output (positive logits divided, negative multiplied);
    frequency (per occurrence) and presence (once) penalties over output tokens, as OpenAI defines them."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    chosen = [requests[i] for i in rows]
    params = [r.sampling_params for r in chosen]
    row_index = torch.tensor(rows, device=device)
    x = logits.index_select(0, row_index)  # (R, V)
    output_counts = _token_counts([r.output_token_ids for r in chosen], vocab, device)  # (R, V)
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        seen = (output_counts > 0) | (_token_counts([r.prompt_token_ids for r in chosen], vocab, device) > 0)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        x = x - frequency * output_counts - presence * (output_counts > 0).float()
    logits[row_index] = x


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(token_lists), vocab) float32: how often each token occurs in each list."""
    counts = torch.zeros((len(token_lists), vocab), dtype=torch.float32, device=device)
    flat = [t for tokens in token_lists for t in tokens]
    if flat:
        ids = torch.tensor(flat, dtype=torch.long, device=device)
        rows = torch.repeat_interleave(
            torch.arange(len(token_lists), device=device),
            torch.tensor([len(tokens) for tokens in token_lists], device=device),
        )
        keep = (ids >= 0) & (ids < vocab)
        counts.index_put_(
            (rows[keep], ids[keep]), torch.ones_like(ids[keep], dtype=torch.float32), accumulate=True
        )
    return counts


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each request's bias. Ids beyond the logits' width are ignored (the engine validates them)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            if token_id < vocab:
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[_RowState]) -> None:
    """Below ``min_tokens`` outputs, EOS and stop tokens cannot be chosen (with ignore_eos too)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            banned = {t for t in (*r.eos_token_ids, *p.stop_token_ids) if t < vocab}
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _truncate(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) what top_k, top_p and min_p exclude, row by row; ``x`` is temperature-scaled (S, V)."""
    vocab = x.shape[1]
    if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1.0 for p in params):
        sorted_x, order = x.sort(dim=-1, descending=True)  # (S, V) each
        return torch.empty_like(x).scatter_(1, order, _mask_sorted(sorted_x, params))
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=x.device).unsqueeze(1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def _mask_sorted(sorted_x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top_k, then top_p, then min_p on rows sorted best first (S, N): the whole vocabulary, or a row's top
    candidates; what they exclude becomes -inf."""
    num_rows, width = sorted_x.shape
    device = sorted_x.device
    rank = torch.arange(width, device=device).expand(num_rows, width)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < width else width for p in params], device=device)
    drop = rank >= top_k.unsqueeze(1)
    x = sorted_x.masked_fill(drop, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        probs = torch.softmax(x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p == 1 keeps everything, even where rounding pushes mass_before to 1.0.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
        x = x.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))  # the best has 0 before: kept
    if any(p.min_p > 0.0 for p in params):
        probs = torch.softmax(x, dim=-1)  # the best token is first: probs[:, :1] is the row's largest
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        x = x.masked_fill(probs < min_p * probs[:, :1], float("-inf"))
    return x


# --- outputs ------------------------------------------------------------------------------------
def _package(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[SampledToken]:
    ids = token_ids.tolist()
    out = [SampledToken(token_id=t) for t in ids]
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return out
    row_index = torch.tensor(wanted, device=raw_logits.device)
    max_k = max(params[i].logprobs or 0 for i in wanted)
    chosen, top = _logprobs(
        raw_logits.index_select(0, row_index), token_ids.index_select(0, row_index), max_k
    )
    for j, i in enumerate(wanted):
        out[i].logprob = chosen[j]
        out[i].top_logprobs = top[j][: params[i].logprobs]
    return out


def _logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Raw-distribution logprob of each row's target, and each row's top k (token_id, logprob), best first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = logprobs.gather(1, target_ids.long().unsqueeze(1)).squeeze(1).tolist()
    if k <= 0:
        return chosen, [[] for _ in chosen]
    values, indices = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    top = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(indices.tolist(), values.tolist())]
    return chosen, top


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: Sequence[int] | torch.Tensor, k: int
) -> list[Logprob]:
    """Logprob of ``target_ids[i]`` under ``logits[i]`` (raw distribution) and the top k, for prompt logprobs.

    ``logits`` (n, vocab) are the predictions at positions 0..n-1; ``target_ids`` the tokens at 1..n.
    """
    if not isinstance(target_ids, torch.Tensor):
        target_ids = torch.tensor(list(target_ids), dtype=torch.long, device=logits.device)
    if logits.dim() != 2 or target_ids.shape != (logits.shape[0],):
        raise RuntimeError(
            f"prompt logprobs: logits {tuple(logits.shape)} vs targets {tuple(target_ids.shape)}"
        )
    chosen, top = _logprobs(logits, target_ids.to(logits.device), k)
    return [Logprob(t, lp, tk) for t, lp, tk in zip(target_ids.tolist(), chosen, top)]


def _mix_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from (request seed, output position): splitmix64 of each, chained."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


__all__ = ["Sampler", "compute_prompt_logprobs"]
