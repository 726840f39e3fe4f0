"""An embedding model's runner: each scheduled row is a whole prompt (the scheduler does not chunk them for an
encoder); the rows go through the encoder as one flat batch and each comes back as its pooled vector. There is
no KV cache: the scheduler's blocks for such a model have no tensors behind them and only bound the tokens in
flight."""

from __future__ import annotations

import torch

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.model.loader import LoadedModel


class PoolingRunner:
    def __init__(self, loaded: LoadedModel) -> None:
        self.model = loaded.model
        self.device = loaded.device

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        rows = scheduler_output.rows
        output = ModelRunnerOutput(sampled={})
        if not rows:
            return output
        input_ids: list[int] = []
        positions: list[int] = []
        for row in rows:
            if row.start_position != 0:
                raise RuntimeError(f"request {row.request_id!r}: an encoder row must hold its whole prompt")
            input_ids.extend(row.token_ids)
            positions.extend(range(row.num_new_tokens))
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        pooled = self.model(ids_t, positions_t, [row.num_new_tokens for row in rows])  # [B, hidden]
        for row, vector in zip(rows, pooled.float().cpu().tolist(), strict=True):
            output.pooled[row.request_id] = vector
        return output
