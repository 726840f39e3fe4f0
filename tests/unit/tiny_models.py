"""Random-weight Llama models for unit tests (imported by test modules; pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from tokenmill.model.config import LlamaConfig
from tokenmill.model.llama import LlamaForCausalLM


def random_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights start uninitialized; norms near 1, the rest large enough to matter
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model
