"""Random-weight Llama models for unit tests (imported by test modules; pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from tokenmill.model.config import LlamaConfig
from tokenmill.model.llama import LlamaForCausalLM


def tiny_config(**overrides: object) -> LlamaConfig:
    """A two-layer GQA Llama config small enough for unit tests; ``overrides`` replace any field."""
    fields: dict[str, object] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    fields.update(overrides)
    return LlamaConfig(**fields)  # type: ignore[arg-type]


def random_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights start uninitialized; norms near 1, the rest large enough to matter
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model
