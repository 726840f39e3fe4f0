"""The embedded model as it loads by default, computing from the GGUF's Q4_1 / Q8_0 blocks, against the same file
dequantized at load (``quantization="fp32"``): the same greedy tokens through the paged engine with chunked
prefill and forced preemption, logits within fp32 tolerance, under 150 MB of weights."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_hf import PROMPTS, PagedRunner

from tokenmill.engine import Engine
from tokenmill.model.quant import QuantizedEmbedding, QuantizedLinear
from tokenmill.sampling_params import SamplingParams


def test_default_keeps_the_blocks_in_under_150_mb(embedded_loaded, embedded_fp32) -> None:
    model = embedded_loaded.model
    assert embedded_loaded.quantization == "gguf"
    assert embedded_loaded.weight_bytes < 150e6, embedded_loaded.describe_weights()
    assert embedded_fp32.weight_bytes > 500e6  # the dequantized copy and its panels
    layer = model.model.layers[0]
    for proj in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert isinstance(proj, QuantizedLinear) and proj.kernel is not None
        assert proj.weight.type_summary().startswith("4bit/g32")  # Q4_1
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.weight.type_summary() == "8bit/g32"  # the tied Q8_0 table
    assert model.lm_head.data.data_ptr() == model.model.embed_tokens.data.data_ptr()
    assert model.backend.decode_stack is not None


def test_logits_match_the_dequantized_path(embedded_loaded, embedded_fp32) -> None:
    prompts = [embedded_loaded.tokenizer.encode(p) for p in PROMPTS]
    logits = []
    for loaded in (embedded_loaded, embedded_fp32):
        runner = PagedRunner(loaded.model, loaded.config, num_blocks=64, block_size=4)
        prefill = runner.step(dict(enumerate(prompts)))  # one flat batch of four prompts
        decode = runner.step({i: [int(t)] for i, t in enumerate(prefill.argmax(-1))})  # the decode stack
        logits.append((prefill, decode))
    for a, b in zip(logits[0], logits[1]):
        assert (a - b).abs().max() < 1e-3


@pytest.mark.parametrize("chunk", [16, 512])
def test_greedy_tokens_equal_through_chunked_prefill_and_preemption(embedded_loaded, embedded_fp32, chunk):
    prompts = [embedded_loaded.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = []
    for loaded in (embedded_loaded, embedded_fp32):
        engine = Engine(
            loaded=loaded, device="cpu", block_size=4, num_kv_blocks=20, max_num_batched_tokens=chunk
        )
        outputs.append([o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)])
        assert engine.stats.num_preemptions > 0
        assert engine.num_free_blocks == engine.num_total_blocks
    assert outputs[0] == outputs[1]


def test_embedding_rows_are_the_dequantized_table(embedded_loaded, embedded_fp32) -> None:
    ids = torch.tensor([0, 1, 17, 49151, 1000])
    rows = embedded_loaded.model.model.embed_tokens(ids)
    assert torch.equal(rows, embedded_fp32.model.model.embed_tokens.weight[ids])  # exact: same fp32 values
