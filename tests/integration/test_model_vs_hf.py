"""tokenmill's Llama against transformers' LlamaForCausalLM: same weights, same logits, same greedy tokens.

Every comparison runs our model the way the engine does: a flat batch over a paged cache whose blocks
come from a shuffled pool, so block tables are never contiguous.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenmill.model.config import LlamaConfig  # noqa: E402
from tokenmill.model.llama import LlamaForCausalLM  # noqa: E402
from tokenmill.model.loader import allocate_kv_cache, load_model  # noqa: E402

ATOL = 1e-3
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


class PagedRunner:
    """Feeds chunks of tokens per sequence through the model, the way the engine's runner does."""

    def __init__(
        self, model: LlamaForCausalLM, config: LlamaConfig, num_blocks: int, block_size: int, seed: int = 0
    ) -> None:
        self.model, self.block_size = model, block_size
        weight = next(model.parameters())
        self.device = weight.device
        self.kv_caches = allocate_kv_cache(config, num_blocks, block_size, weight.dtype, self.device)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Append ``chunks[seq]`` to each sequence; logits of each chunk's last token, ``[len(chunks), vocab]``."""
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            self.lens[seq] = end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            input_ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
        meta = self.model.plan_attention(query_lens, seq_lens, tables, self.block_size)
        to_device = {"dtype": torch.int64, "device": self.device}
        hidden = self.model(
            torch.tensor(input_ids, **to_device), torch.tensor(positions, **to_device), meta, self.kv_caches
        )
        last_rows = torch.tensor(meta.query_start_loc[1:], **to_device) - 1
        return self.model.compute_logits(hidden[last_rows]).cpu()


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of one unpadded sequence, ``[T, vocab]``."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def assert_flat_batch_matches(model, config, hf_model, prompts: list[list[int]], block_size: int) -> None:
    runner = PagedRunner(
        model,
        config,
        num_blocks=sum(len(p) for p in prompts) // block_size + 4 * len(prompts),
        block_size=block_size,
    )
    ours = runner.step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        expected = hf_logits(hf_model, prompt)[-1]
        torch.testing.assert_close(
            ours[i], expected, atol=ATOL, rtol=0, msg=f"prompt {i} (length {len(prompt)})"
        )


def assert_incremental_matches(
    model, config, hf_model, tokens: list[int], prefill_len: int, block_size: int
) -> None:
    """Prefill, then a chunk after the cached prefix, then one token at a time: each step vs HF's full forward."""
    expected = hf_logits(hf_model, tokens)  # [T, vocab]
    runner = PagedRunner(
        model, config, num_blocks=len(tokens) // block_size + 2, block_size=block_size, seed=1
    )
    chunk_end = prefill_len + (len(tokens) - prefill_len) // 2
    steps = [(0, prefill_len), (prefill_len, chunk_end)] + [(p, p + 1) for p in range(chunk_end, len(tokens))]
    for start, end in steps:
        logits = runner.step({0: tokens[start:end]})[0]
        torch.testing.assert_close(logits, expected[end - 1], atol=ATOL, rtol=0, msg=f"tokens {start}:{end}")


# --- tiny random models saved by transformers ----------------------------------------------------
def _tiny_hf_model(tie: bool = False, rope_scaling: dict | None = None, seed: int = 0, **shape: int):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=shape.get("hidden_size", 64),
        intermediate_size=shape.get("intermediate_size", 112),
        num_hidden_layers=2,
        num_attention_heads=shape.get("num_attention_heads", 4),
        num_key_value_heads=shape.get("num_key_value_heads", 2),
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers edits it in place
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the default init (std 0.02) gives near-zero logits; make differences visible
        for name, param in model.named_parameters():
            param.copy_(
                1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param)
            )
    return model


def _save_with_tokenizer(hf_model, model_dir: Path) -> None:
    """save_pretrained plus a word-level tokenizer.json over the same vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_model.save_pretrained(model_dir)
    vocab = {f"w{i}": i for i in range(hf_model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))


def _random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def test_tiny_gqa_untied_dir_loaded_by_load_model(tmp_path: Path) -> None:
    hf_model = _tiny_hf_model(tie=False)
    _save_with_tokenizer(hf_model, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.config.num_key_value_heads == 2 and not loaded.config.tie_word_embeddings
    assert loaded.tokenizer.encode("w5 w7", add_special_tokens=False) == [5, 7]
    prompts = _random_prompts([1, 7, 33, 16, 60], 96)
    assert_flat_batch_matches(loaded.model, loaded.config, hf_model, prompts, block_size=4)
    assert_incremental_matches(
        loaded.model, loaded.config, hf_model, _random_prompts([40], 96, 1)[0], 9, block_size=4
    )


def test_every_kernel_variant_matches_hf(kernel_variant, tmp_path: Path) -> None:
    """Each C++ variant this CPU runs, through the whole model: the tiled prefill, the register decode attention
    (head size 64, 3 query heads per KV head, as SmolLM2), the panel matmuls and the decode stack."""
    hf_model = _tiny_hf_model(
        seed=3, hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1
    )
    _save_with_tokenizer(hf_model, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")  # packed for the variant the fixture loaded
    assert (loaded.model.backend.decode_stack is not None) == (kernel_variant.isa() != "base")
    prompts = _random_prompts([1, 7, 33, 70], 96, 4)
    assert_flat_batch_matches(loaded.model, loaded.config, hf_model, prompts, block_size=16)
    assert_incremental_matches(
        loaded.model, loaded.config, hf_model, _random_prompts([90], 96, 5)[0], 40, block_size=16
    )


def test_tiny_tied_embeddings(tmp_path: Path) -> None:
    hf_model = _tiny_hf_model(tie=True, seed=1)
    _save_with_tokenizer(hf_model, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.config.tie_word_embeddings and loaded.model.lm_head is None
    assert_flat_batch_matches(
        loaded.model, loaded.config, hf_model, _random_prompts([5, 12], 96, 2), block_size=8
    )


def test_tiny_llama3_rope_scaling_beyond_original_context() -> None:
    hf_model = _tiny_hf_model(rope_scaling=LLAMA3_SCALING, seed=2)
    config = LlamaConfig.from_hf_dict(hf_model.config.to_dict())
    assert config.rope_scaling == LLAMA3_SCALING
    model = LlamaForCausalLM(config)
    model.load_hf_state_dict(hf_model.state_dict())
    # positions well past original_max_position_embeddings (32)
    prompts = _random_prompts([150, 3, 90], 96, 3)
    assert_flat_batch_matches(model, config, hf_model, prompts, block_size=16)
    assert_incremental_matches(model, config, hf_model, _random_prompts([120], 96, 4)[0], 50, block_size=16)


def _run_prefill_and_decode(model, config, prompt: list[int], num_decode: int) -> torch.Tensor:
    """Logits after the prefill of ``prompt[:-num_decode]`` and after each later token, ``[num_decode + 1, vocab]``."""
    runner = PagedRunner(model, config, num_blocks=len(prompt) // 4 + 2, block_size=4)
    prefill_len = len(prompt) - num_decode
    rows = [runner.step({0: prompt[:prefill_len]})[0]]
    rows += [runner.step({0: [token]})[0] for token in prompt[prefill_len:]]
    return torch.stack(rows)


def test_tiny_bfloat16_runs_close_to_float32() -> None:
    """bf16 is what CUDA gets: the same code path (prefill and decode) must work, loosely, in that dtype."""
    hf_model = _tiny_hf_model(seed=3)
    config = LlamaConfig.from_hf_dict(hf_model.config.to_dict())
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_hf_state_dict(hf_model.state_dict())
    prompt = _random_prompts([24], 96, 5)[0]
    ours = _run_prefill_and_decode(model, config, prompt, num_decode=4)
    expected = hf_logits(hf_model, prompt)[-5:]
    assert ours.dtype == torch.float32
    assert (ours - expected).abs().max() < 0.1 * expected.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_on_cuda_matches_hf(dtype: torch.dtype) -> None:
    hf_model = _tiny_hf_model(rope_scaling=LLAMA3_SCALING, seed=4)
    config = LlamaConfig.from_hf_dict(hf_model.config.to_dict())
    model = LlamaForCausalLM(config).to(device="cuda", dtype=dtype)
    model.load_hf_state_dict(hf_model.state_dict())
    prompt = _random_prompts([70], 96, 6)[0]
    ours = _run_prefill_and_decode(model, config, prompt, num_decode=5)
    expected = hf_logits(hf_model, prompt)[-6:]
    tolerance = 2e-3 if dtype == torch.float32 else 0.1 * expected.abs().max().item()
    assert (ours - expected).abs().max() < tolerance


# --- the embedded SmolLM2-135M-Instruct GGUF -----------------------------------------------------
@pytest.fixture(scope="module")
def hf_gguf_reference(embedded_loaded, hf_gguf):
    """transformers' own dequantization and Q/K un-permutation of the same GGUF file.

    ``from_pretrained(gguf_file=...)`` insists on ``accelerate``; ``load_gguf_checkpoint`` is the same
    conversion without it.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = embedded_loaded.source
    with hf_gguf.shared_parsing():
        parsed = load_gguf_checkpoint(path, return_tensors=False)["config"]
    hf_config = transformers.LlamaConfig(**{k: v for k, v in parsed.items() if k != "model_type"})
    hf_config._attn_implementation = "eager"
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(hf_config)
    with hf_gguf.shared_parsing():
        state_dict = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.LlamaForCausalLM(hf_config)
    model.load_state_dict(state_dict, strict=False)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model.eval()


@pytest.fixture(params=["embedded_loaded", "embedded_fp32"])
def embedded_either(request):
    """The embedded model as loaded by default (its GGUF blocks kept) and dequantized at load."""
    return request.getfixturevalue(request.param)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]


@pytest.mark.slow
def test_embedded_flat_batch_and_incremental_decode(embedded_either, hf_gguf_reference) -> None:
    loaded = embedded_either
    assert loaded.config.num_hidden_layers == 30 and loaded.config.num_key_value_heads == 3
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert_flat_batch_matches(loaded.model, loaded.config, hf_gguf_reference, prompts, block_size=4)
    assert_incremental_matches(loaded.model, loaded.config, hf_gguf_reference, prompts[2], 6, block_size=4)


@pytest.mark.slow
def test_embedded_greedy_matches_hf_generate(embedded_either, hf_gguf_reference) -> None:
    loaded = embedded_either
    num_new = 20
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:3]]
    runner = PagedRunner(loaded.model, loaded.config, num_blocks=64, block_size=4, seed=2)
    generated: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    logits = runner.step(dict(enumerate(prompts)))  # all prompts in one prefill batch
    active = list(generated)
    for _ in range(num_new):
        for seq, row in zip(active, logits.argmax(dim=-1).tolist()):
            generated[seq].append(row)
        active = [s for s in active if generated[s][-1] not in loaded.config.eos_token_ids]
        active = [s for s in active if len(generated[s]) < num_new]
        if not active:
            break
        logits = runner.step({s: generated[s][-1:] for s in active})  # decode rows batched together
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            out = hf_gguf_reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=num_new,
                eos_token_id=list(loaded.config.eos_token_ids),
                pad_token_id=loaded.config.eos_token_ids[0],
            )
        assert generated[i] == out[0, len(prompt) :].tolist(), PROMPTS[i]
