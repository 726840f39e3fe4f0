"""Weight-only int8: the per-row quantizer, Int8Linear against its own dequantized weight, a whole model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_model, tiny_config

from tokenmill.model.config import LlamaConfig
from tokenmill.model.llama import Linear, LlamaForCausalLM, hf_tensor_names
from tokenmill.model.loader import allocate_kv_cache, load_model
from tokenmill.model.quant import Int8Linear, quantize_model_int8, quantize_per_channel


def _tiny_config(tie: bool) -> LlamaConfig:
    return tiny_config(tie_word_embeddings=tie)


def _all_logits(model: LlamaForCausalLM, config: LlamaConfig, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, prefilled in one step: ``[T, vocab]``."""
    block_size = 4
    num_blocks = -(-len(token_ids) // block_size)
    kv_caches = allocate_kv_cache(config, num_blocks, block_size, torch.float32, "cpu")
    meta = model.plan_attention([len(token_ids)], [len(token_ids)], [list(range(num_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)), meta, kv_caches)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 64, generator=generator) * torch.rand(300, 1, generator=generator) * 3
    weight[7] = 0.0  # an all-zero row must not divide by zero
    q, scales = quantize_per_channel(weight, dtype)
    assert q.dtype == torch.int8 and scales.dtype == dtype and scales.shape == (300,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    step = scales.float()[:, None]  # [out, 1]
    error = (weight - q.float() * step).abs()
    assert bool((error <= step / 2 * (1 + 1e-6)).all()), float((error / step).max())
    assert bool((q[7] == 0).all())


def test_int8_linear_matches_matmul_on_its_dequantized_weight() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 112, generator=generator) * 0.2
    layer = Int8Linear.from_weight(weight)
    assert layer.weight_int8.dtype == torch.int8 and layer.scales.dtype == torch.float32
    dequantized = layer.dequantize()  # [96, 112]
    assert float((dequantized - weight).abs().max()) <= float(layer.scales.max()) / 2 * (1 + 1e-6)
    for shape in [(1, 112), (7, 112), (2, 3, 112)]:
        x = torch.randn(shape, generator=generator)
        out = layer(x)
        assert out.shape == (*shape[:-1], 96) and out.dtype == torch.float32
        # The CPU kernel takes bf16 activations and returns bf16: compare against that rounding, one ulp.
        expected = F.linear(x.bfloat16().float(), dequantized)
        torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-5)


def test_int8_linear_fallback_path_matches_too() -> None:
    """The non-CPU path (cast, matmul, scale columns), run on CPU tensors by calling it directly."""
    generator = torch.Generator().manual_seed(2)
    layer = Int8Linear.from_weight(torch.randn(40, 64, generator=generator))
    x = torch.randn(5, 64, generator=generator)
    fallback = F.linear(x, layer.weight_int8.float()) * layer.scales
    torch.testing.assert_close(fallback, F.linear(x, layer.dequantize()), rtol=1e-5, atol=1e-5)


def test_int8_linear_rejects_bad_tensors() -> None:
    with pytest.raises(ValueError, match="int8"):
        Int8Linear(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="scales"):
        Int8Linear(torch.zeros(4, 8, dtype=torch.int8), torch.ones(8))


@pytest.mark.parametrize("tie", [False, True])
def test_quantized_model_logits_close_to_fp32(tie: bool) -> None:
    config = _tiny_config(tie)
    model = random_model(config)
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    reference = _all_logits(model, config, tokens)
    embedding = model.model.embed_tokens.weight.clone()

    assert quantize_model_int8(model) is model
    for layer in model.model.layers:
        for module in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert isinstance(module, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear)
    assert not any(isinstance(m, Linear) for m in model.modules())
    # the embedding table stays full precision for lookups; a tied head got its own int8 copy
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding, rtol=0, atol=0)

    logits = _all_logits(model, config, tokens)
    assert logits.shape == reference.shape and logits.dtype == torch.float32
    # int8 weights and bf16 activations: ~2-3% relative error on these random weights (std 0.15)
    assert float((logits - reference).norm() / reference.norm()) < 0.06
    assert int((logits.argmax(-1) == reference.argmax(-1)).sum()) >= 21  # of 24; random logits have near-ties

    assert quantize_model_int8(model) is model  # a second call changes nothing
    torch.testing.assert_close(_all_logits(model, config, tokens), logits, rtol=0, atol=0)


def _write_tiny_hf_dir(model_dir: Path, config: LlamaConfig) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    model = random_model(config, seed=4)
    fused = dict(model.named_parameters())
    q_rows, kv_rows = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in hf_tensor_names(config):
        prefix, kind = name.rsplit(".", 2)[0], name.split(".")[-2]
        if kind in ("q_proj", "k_proj", "v_proj"):
            qkv = fused[f"{prefix}.qkv_proj.weight"]
            start = {"q_proj": 0, "k_proj": q_rows, "v_proj": q_rows + kv_rows}[kind]
            tensors[name] = qkv[start : start + (q_rows if kind == "q_proj" else kv_rows)].clone()
        elif kind in ("gate_proj", "up_proj"):
            gate, up = fused[f"{prefix}.gate_up_proj.weight"].chunk(2)
            tensors[name] = (gate if kind == "gate_proj" else up).clone()
        else:
            tensors[name] = fused[name].clone()
    model_dir.mkdir()
    save_file(tensors, str(model_dir / "model.safetensors"))
    hf_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0")).save(str(model_dir / "tokenizer.json"))


def test_load_model_applies_int8(tmp_path: Path) -> None:
    config = _tiny_config(tie=True)
    _write_tiny_hf_dir(tmp_path / "tiny", config)
    fp32 = load_model(str(tmp_path / "tiny"), device="cpu")
    int8 = load_model(str(tmp_path / "tiny"), device="cpu", quantization="int8")
    assert fp32.model.lm_head is None and isinstance(fp32.model.model.layers[0].mlp.down_proj, Linear)
    assert isinstance(int8.model.lm_head, Int8Linear)
    assert isinstance(int8.model.model.layers[1].self_attn.qkv_proj, Int8Linear)
    tokens = list(range(3, 20))
    reference = _all_logits(fp32.model, fp32.config, tokens)
    logits = _all_logits(int8.model, int8.config, tokens)
    assert float((logits - reference).norm() / reference.norm()) < 0.06


def test_load_model_rejects_unknown_quantization(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="quantization must be one of None, gguf, gguf-q8, gguf-q4, fp32, int8, got 'int4'"
    ):
        load_model(str(tmp_path), device="cpu", quantization="int4")
