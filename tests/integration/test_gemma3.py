"""Gemma 3 (text) as configuration of the one decoder, against transformers.

The Hugging Face directory path runs with the other families in ``test_model_families.py``. Here: the same kind of
tiny random model written as GGUF the way llama.cpp's converter writes Gemma 3 (``write_family_gguf``: its tensor
names, RMSNorm weights stored as 1 + w; a sliding window every layer but each sixth, whose RoPE base and query
scale the reader must supply), in F32 and with Q8_0 projections kept as blocks; and the real ``gemma-3-270m`` file (slow), whose greedy
continuations must equal transformers' reading the same file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_families import (  # noqa: E402
    VOCAB,
    embedded_tokenizer_fields,  # noqa: F401  (a fixture)
    prompts,
    write_family_gguf,
)
from test_model_vs_hf import PagedRunner, assert_flat_batch_matches, assert_incremental_matches  # noqa: E402

from tokenmill.model.loader import load_model  # noqa: E402


def build_gemma3(seed: int = 0, window: int = 8):
    """Six layers as llama.cpp assumes Gemma 3's: five local (RoPE base 10,000, a window) and a global one
    (base 1e6), queries scaled by head_dim ** -0.5; random weights, norms around 0 (they mean 1 + w)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=window,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.tie_weights()
    return model


def test_gemma3_gguf_matches_transformers(embedded_tokenizer_fields, tmp_path: Path) -> None:  # noqa: F811
    hf_model = build_gemma3()
    path = tmp_path / "gemma3-f32.gguf"
    write_family_gguf(hf_model, "gemma3", path, embedded_tokenizer_fields, quantize=None)
    loaded = load_model(str(path), device="cpu")
    config = loaded.config
    assert config.model_type == "gemma3" and config.sandwich_norms and config.hidden_act == "gelu_tanh"
    assert [config.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    assert config.attention_scale == 64**-0.5 and config.rope_local_theta == 10_000.0
    # prompts shorter and longer than the window, in one flat batch
    assert_flat_batch_matches(loaded.model, config, hf_model, prompts([3, 7, 20, 33], seed=3), block_size=4)
    # a prefill within the window, a chunk past it, then decode steps (the windowed path on local layers)
    assert_incremental_matches(loaded.model, config, hf_model, prompts([30], seed=5)[0], 6, block_size=4)


@pytest.mark.slow  # 7.5 s; every block format against the gguf package's dequantize runs in the unit tests
def test_gemma3_gguf_blocks_equal_the_file_dequantized(embedded_tokenizer_fields, tmp_path: Path) -> None:  # noqa: F811
    hf_model = build_gemma3(seed=1)
    path = tmp_path / "gemma3-q8_0.gguf"
    write_family_gguf(hf_model, "gemma3", path, embedded_tokenizer_fields, quantize="Q8_0")
    kept = load_model(str(path), device="cpu", quantization="gguf")
    dequantized = load_model(str(path), device="cpu", quantization="fp32")
    assert kept.quantization == "gguf"
    batch = dict(enumerate(prompts([5, 18, 30], seed=4)))
    a = PagedRunner(kept.model, kept.config, 64, 4).step(batch)
    b = PagedRunner(dequantized.model, dequantized.config, 64, 4).step(batch)
    assert (a - b).abs().max() < 1e-3


GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Water boils at a temperature of",
]


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers_on_the_same_file(hf_gguf) -> None:
    """``gemma-3-270m`` (Q4_K_M: Q8_0, Q5_0, Q4_K and Q6_K blocks, 262k-token SentencePiece vocabulary): the
    tokenizers agree and five greedy continuations equal transformers' reading the same file in fp32."""
    from tokenmill.engine import Engine
    from tokenmill.model import registry as models
    from tokenmill.sampling_params import SamplingParams

    path = models.pull("gemma-3-270m", progress=False, log=lambda s: None)
    loaded = load_model(str(path), device="cpu", quantization="gguf")  # the exact path, to compare
    assert loaded.quantization == "gguf" and loaded.config.model_type == "gemma3"
    assert loaded.config.vocab_size == 262144 and loaded.config.head_dim == 256
    hf_tok = hf_gguf.tokenizer(path)
    ids = [loaded.tokenizer.encode(p) for p in GEMMA_PROMPTS]  # with BOS, as the model was trained
    assert ids == [hf_tok(p)["input_ids"] for p in GEMMA_PROMPTS]
    engine = Engine(loaded=loaded, num_kv_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in engine.generate(ids, params)]
    hf = hf_gguf.model(path)
    for prompt_ids, got in zip(ids, ours):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt_ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )
        expected = out[0, len(prompt_ids) :].tolist()
        assert got == expected, (hf_tok.decode(got), hf_tok.decode(expected))
