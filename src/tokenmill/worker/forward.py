"""One forward pass over a schedule's rows: the runner, the draft model and every tensor-parallel rank run it."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.core.sched_output import ScheduledRow
from tokenmill.model.llama import KVCache, LlamaForCausalLM


def forward_rows(
    model: LlamaForCausalLM,
    rows: list[ScheduledRow],
    kv_caches: list[KVCache],
    block_size: int,
    device: torch.device | str,
    lora: Any = None,
) -> torch.Tensor:
    """The model over a schedule's rows as one flat batch -> hidden states ``[num_tokens, hidden]``; rank 0 and
    every tensor-parallel worker run this same function on the same rows. ``lora``: the step's adapters
    (``model.lora.StepLoRA``), None when no row has one."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    for row in rows:
        input_ids.extend(row.token_ids)
        positions.extend(range(row.start_position, row.seq_len))
        if row.is_prefill or row.num_new_tokens == 1:
            query_lens.append(row.num_new_tokens)
            seq_lens.append(row.seq_len)
            block_tables.append(row.block_ids)
        else:  # a verification (or a draft's catch-up): each token attends as a decode row over its causal
            # prefix, computed as a plain decode step computes it; a step of such rows is decode-only, so the
            # CPU backend's decode stack takes it whole
            query_lens.extend([1] * row.num_new_tokens)
            seq_lens.extend(range(row.start_position + 1, row.seq_len + 1))
            block_tables.extend([row.block_ids] * row.num_new_tokens)
    meta = model.plan_attention(query_lens, seq_lens, block_tables, block_size)
    meta.lora = lora
    input_ids_t = torch.tensor(input_ids, dtype=torch.long, device=device)  # [T]
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)  # [T]
    return model(input_ids_t, positions_t, meta, kv_caches)  # type: ignore[no-any-return]
