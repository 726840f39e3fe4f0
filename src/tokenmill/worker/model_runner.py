"""Model runner: a SchedulerOutput in, tensors through the model, one sampled token per wanting row out.

The KV tensors live here (per layer ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and V); the
scheduler only hands out block ids. Logits are computed for the rows that sample, never for a whole prompt
unless the request asked for prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import Any

import torch

from tokenmill.config import DEFAULT_DRAFT_P_MIN
from tokenmill.core.sched_output import ModelRunnerOutput, ScheduledRow, SchedulerOutput
from tokenmill.model.loader import LoadedModel, allocate_kv_cache
from tokenmill.outputs import Logprob
from tokenmill.request import Request
from tokenmill.worker.forward import forward_rows
from tokenmill.worker.sampler import Sampler, compute_prompt_logprobs


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        requests: Mapping[str, Request],
        seed: int = 0,
        tp_group: Any = None,
        draft: LoadedModel | None = None,
        draft_p_min: float = DEFAULT_DRAFT_P_MIN,
        kv_dtype: torch.dtype | None = None,
        lora_manager: Any = None,
    ) -> None:
        """``requests``: the engine's table of live requests, read (never written) for their sampling state.
        ``tp_group``: a :class:`~tokenmill.worker.tensor_parallel.TensorParallelGroup` (rank 0 of a
        tensor-parallel model: the KV cache holds this rank's heads, each step's rows go to the workers).
        ``draft``: speculative decoding's draft model (its KV in its own tensors, same block ids), ending a
        row's proposal at a token it gives less than ``draft_p_min``. ``lora_manager``: the LoRA adapters
        (``worker/lora_manager.py``), None with LoRA off."""
        self.loaded = loaded
        self.requests = requests
        self.tp_group = tp_group
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        kv_config = loaded.config if tp_group is None else tp_group.local_config
        self.kv_dtype = kv_dtype or loaded.dtype  # the KV cache's elements (EngineConfig.kv_cache_dtype)
        self.kv_caches = allocate_kv_cache(kv_config, num_blocks, block_size, self.kv_dtype, loaded.device)
        if self.device.type == "cpu":  # after the KV cache: it stays mapped, given back when the engine ends
            from tokenmill.model.cpu.allocator import keep_step_memory

            keep_step_memory()
        self.sampler = Sampler(seed)
        self.lora_manager = lora_manager
        self.num_steps = 0
        self.drafter = None  # speculative decoding's draft model (worker/drafter.py): fills rows' draft slots
        if draft is not None:
            from tokenmill.worker.drafter import Drafter

            self.drafter = Drafter(draft, num_blocks, block_size, requests, draft_p_min)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        rows = scheduler_output.rows
        if not rows:
            return ModelRunnerOutput(sampled={})
        output = ModelRunnerOutput(sampled={})
        if self.drafter is not None:
            filled = self.drafter.fill(rows)
            for scheduled, row in zip(rows, filled, strict=True):
                if row.num_spec_tokens < scheduled.num_spec_tokens:  # the draft stopped short of its slots
                    output.num_drafted[row.request_id] = row.num_spec_tokens
            rows = filled
        if self.tp_group is not None:  # the workers run the same forward on their shards
            self.tp_group.broadcast(
                rows, {} if self.lora_manager is None else self.lora_manager.requests_of(rows)
            )
        self.num_steps += 1
        lora = None if self.lora_manager is None else self.lora_manager.step(rows, self.num_steps)
        hidden = forward_rows(self.model, rows, self.kv_caches, self.block_size, self.device, lora)  # [T, H]
        query_start_loc = [0, *accumulate(row.num_new_tokens for row in rows)]
        requests = [self.requests[row.request_id] for row in rows]
        self._sample(rows, requests, hidden, query_start_loc, output)
        self._prompt_logprobs(rows, hidden, query_start_loc, output)
        return output

    def _sample(
        self,
        rows: list[ScheduledRow],
        requests: list[Request],
        hidden: torch.Tensor,
        query_start_loc: list[int],
        output: ModelRunnerOutput,
    ) -> None:
        """A token for each sampling row from its last position's logits; a row with a proposal is verified at
        each of its 1 + num_spec_tokens positions (the sampler's ``verify``)."""
        plain = [i for i, row in enumerate(rows) if row.sample and not row.num_spec_tokens]
        spec = [i for i, row in enumerate(rows) if row.sample and row.num_spec_tokens]
        index = [query_start_loc[i + 1] - 1 for i in plain]
        for i in spec:
            index.extend(range(query_start_loc[i + 1] - 1 - rows[i].num_spec_tokens, query_start_loc[i + 1]))
        if not index:
            return
        logits = self.model.compute_logits(hidden[torch.tensor(index, device=self.device)])  # [n, V] float32
        if plain:
            sampled = self.sampler(logits[: len(plain)], [requests[i] for i in plain])
            for i, token in zip(plain, sampled, strict=True):
                output.sampled[rows[i].request_id] = token
        if spec:
            verified = self.sampler.verify(
                logits[len(plain) :], [requests[i] for i in spec], [rows[i].spec_token_ids for i in spec]
            )
            for i, tokens in zip(spec, verified, strict=True):
                output.verified[rows[i].request_id] = tokens

    def _prompt_logprobs(
        self,
        rows: list[ScheduledRow],
        hidden: torch.Tensor,
        query_start_loc: list[int],
        output: ModelRunnerOutput,
    ) -> None:
        """The prompt logprobs of each prefill row whose request asked for them, each entry once."""
        for i, row in enumerate(rows):
            request = self.requests[row.request_id]
            k = request.sampling_params.prompt_logprobs
            if k is None or not row.is_prefill:
                continue
            # Prompt positions covered by this row; position p's logits score prompt token p + 1. Entries
            # already stored (index p + 1 for position p) are not computed again: a request preempted and
            # recomputing its prompt gets each entry exactly once.
            num_stored = len(request.prompt_logprobs or [])
            first = max(row.start_position, num_stored - 1)
            end = min(row.seq_len, request.num_prompt_tokens - 1)
            entries: list[Logprob | None] = [None] if first == 0 and num_stored == 0 else []
            if end > first:
                start = query_start_loc[i] + (first - row.start_position)
                logits = self.model.compute_logits(hidden[start : start + (end - first)])  # [n, V]
                targets = torch.tensor(request.prompt_token_ids[first + 1 : end + 1], device=self.device)
                entries.extend(compute_prompt_logprobs(logits, targets, k))
            if entries:
                output.prompt_logprobs[row.request_id] = entries
