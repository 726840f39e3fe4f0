"""Random-weight Llama models for unit tests (imported by test modules; pytest puts this folder on sys.path)."""

from __future__ import annotations

import gguf
import numpy as np
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


# the fp16 fields of each type's block (byte offsets): filled with finite values, the rest random bytes
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_blocks(type_name: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """``[rows, bytes_per_row]`` of random valid blocks of ``type_name`` (as ``gguf.ReaderTensor.data``)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    num_blocks = rows * in_features // block_size
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[type_name]:
        d = (rng.standard_normal(num_blocks) * 0.02).astype(np.float16)
        raw[:, offset : offset + 2] = d.view(np.uint8).reshape(num_blocks, 2)
    return raw.reshape(rows, -1)
