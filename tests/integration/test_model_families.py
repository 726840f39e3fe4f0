"""Every supported family against transformers itself: a tiny random model of each, built and saved by
transformers here (a few layers, GQA, odd head sizes, the embedded tokenizer's vocabulary), loaded from its
directory by tokenmill. Logits of several prompts in one flat batch and step by step; greedy continuations
token for token against ``generate``, through the paged engine with chunked prefill and forced preemption;
a sliding window exceeded by the prompt; and the same model written as GGUF with llama.cpp's names."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_vs_hf import assert_flat_batch_matches, assert_incremental_matches  # noqa: E402

from tokenmill.engine import Engine  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

VOCAB = 49152  # the embedded tokenizer's
# family -> (transformers config class, model class, config fields): odd sizes on purpose
FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=96, num_attention_heads=2, num_key_value_heads=1, intermediate_size=160
        ),  # head_dim 48
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=160, num_attention_heads=2, num_key_value_heads=1, intermediate_size=224
        ),  # 80, bias
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=48, intermediate_size=192
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=192,
            sliding_window=16,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            intermediate_size=192,
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=48,  # not head_dim: the scale is the config's
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            hidden_size=192,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=256,
            partial_rotary_factor=0.5,  # 48 of 96 dims rotated
            sliding_window=24,
        ),
    ),
}
TIED = {"qwen2", "gemma3"}  # tied families; the others untied
NO_DECODE_STACK = {
    "gemma3"
}  # layers the C++ decode stack does not compute (sandwich norms, GeGLU, local RoPE)


def build_hf(family: str, seed: int = 0, **overrides):
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB,
        num_hidden_layers=3,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=family in TIED,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
        **{**fields, **overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # the default init gives near-zero logits; make differences visible
        for name, param in model.named_parameters():
            noise = torch.randn_like(param)
            param.copy_(1 + 0.1 * noise if "norm" in name else (0.05 if "bias" in name else 0.15) * noise)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, hf_gguf) -> Path:
    """The embedded model's tokenizer as transformers saves it (tokenizer.json and its config)."""
    from tokenmill.model.embedded import embedded_model_path

    out = tmp_path_factory.mktemp("tokenizer")
    hf_gguf.tokenizer(embedded_model_path()).save_pretrained(out)
    return out


def save_dir(hf_model, tokenizer_files: Path, model_dir: Path) -> Path:
    hf_model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_files / name).is_file():
            (model_dir / name).write_bytes((tokenizer_files / name).read_bytes())
    return model_dir


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(
    kernel_variant, family: str, tokenizer_files: Path, tmp_path: Path
) -> None:
    """On every kernel variant this CPU runs: the biases, q/k norms, partial rotary and head sizes 48-96 go
    through the C++ decode stack, the fused RoPE and the tiled prefill (or their fallbacks) of each."""
    hf_model = build_hf(family)
    loaded = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path)), device="cpu")
    config = loaded.config
    assert config.model_type == family
    assert config.tie_word_embeddings == (family in TIED)
    if family == "qwen3":
        assert config.head_dim == 48 and config.qk_norm
    if family == "phi3":
        assert config.rotary_dim == 48 and config.sliding_window == 24
    if family == "qwen2":
        assert config.qkv_bias and not config.o_bias
    # several lengths in one flat batch (the longest past mistral's and phi3's windows), then step by step
    assert_flat_batch_matches(loaded.model, config, hf_model, prompts([1, 7, 30, 13, 45]), block_size=4)
    assert_incremental_matches(loaded.model, config, hf_model, prompts([40], 1)[0], 9, block_size=4)
    if family == "gemma3":
        assert config.sandwich_norms and config.hidden_act == "gelu_tanh" and config.qk_norm
        assert config.attention_scale == 48**-0.5 and config.rope_local_theta == 10_000.0
        assert [config.layer_window(i) for i in range(3)] == [16, 16, None]
    expects_stack = kernel_variant.isa() != "base" and family not in NO_DECODE_STACK
    assert (loaded.model.backend.decode_stack is not None) == expects_stack


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_generate_through_chunked_prefill_and_preemption(
    family: str, tokenizer_files: Path, tmp_path: Path
) -> None:
    hf_model = build_hf(family, seed=1)
    loaded = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path)), device="cpu")
    batch = prompts([5, 21, 34, 9], seed=2)
    num_new = 16
    # a sliding window gives back blocks as it goes: a smaller pool still runs dry
    num_kv_blocks = 14 if loaded.config.sliding_window else 26
    engine = Engine(
        loaded=loaded, device="cpu", block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=12,
        max_num_seqs=4,
    )  # fmt: skip
    outputs = engine.generate(
        batch, SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert engine.stats.num_preemptions > 0, "the pool was meant to run dry"
    assert engine.num_free_blocks == engine.num_total_blocks
    for prompt, out in zip(batch, outputs):
        with torch.inference_mode():
            expected = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected, family


def test_sliding_window_prompt_longer_than_the_window(tokenizer_files: Path, tmp_path: Path) -> None:
    """Mistral with an 8-token window on a 60-token prompt: every position's logits, prefill in chunks that
    start past the window, then decode far beyond it."""
    hf_model = build_hf("mistral", seed=4, sliding_window=8)
    loaded = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path)), device="cpu")
    assert loaded.config.sliding_window == 8
    tokens = prompts([60], seed=5)[0]
    assert_incremental_matches(loaded.model, loaded.config, hf_model, tokens, 20, block_size=4)
    assert_flat_batch_matches(
        loaded.model, loaded.config, hf_model, [tokens, tokens[:30], tokens[:5]], block_size=4
    )


def test_qwen2_window_only_on_the_upper_layers(tokenizer_files: Path, tmp_path: Path) -> None:
    """use_sliding_window with max_window_layers=1: layers 1 and 2 see a window of 6, layer 0 everything."""
    hf_model = build_hf("qwen2", seed=6, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    loaded = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path)), device="cpu")
    assert [loaded.config.layer_window(i) for i in range(3)] == [None, 6, 6]
    assert_incremental_matches(
        loaded.model, loaded.config, hf_model, prompts([30], seed=7)[0], 10, block_size=4
    )


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},  # Qwen2.5's 128k form
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 24, "beta_fast": 16,
         "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": False},
    ],
)  # fmt: skip
def test_yarn_rope_matches_transformers(rope_scaling, tokenizer_files: Path, tmp_path: Path) -> None:
    """A tiny Qwen2 with YaRN scaling (an original context of 16-24 tokens, so the prompts run past it): logits
    within the suite's tolerance of transformers', flat and incremental."""
    from test_model_vs_hf import assert_flat_batch_matches

    hf_model = build_hf("qwen2", seed=3, rope_scaling=rope_scaling)
    loaded = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path)), device="cpu")
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling["rope_type"] == "yarn"
    assert_flat_batch_matches(
        loaded.model, loaded.config, hf_model, prompts([5, 40, 70], seed=2), block_size=4
    )
    assert_incremental_matches(
        loaded.model, loaded.config, hf_model, prompts([50], seed=4)[0], 8, block_size=4
    )


UNSUPPORTED = [
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "gemma2"),
    ({"model_type": "qwen2_moe", "num_experts": 8}, "MoE"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "MoE"),
    ({"model_type": "qwen2", "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    (
        {
            "model_type": "qwen3",
            "layer_types": ["full_attention", "chunked_attention", "full_attention"],
            "use_sliding_window": True,
            "sliding_window": 4,
        },
        "chunked_attention",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("overrides", "named"), UNSUPPORTED)
def test_unsupported_configs_are_value_errors_naming_the_field(overrides, named, tmp_path: Path) -> None:
    base = build_hf("llama").config.to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**base, **overrides}))
    with pytest.raises(ValueError, match=named):
        load_model(str(tmp_path), device="cpu")


# --- the same models as GGUF files, tensor names and metadata as llama.cpp writes them ------------------
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # phi3
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # phi3: gate and up in one tensor
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_LAYER_BY_ARCH = {  # Gemma 3's norms: after attention, before and after the MLP
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
}


def _llama_cpp_permute(w, num_heads: int):
    """HF rows (i, i + D/2) of each head -> GGUF's interleaved (2i, 2i + 1), as llama.cpp's converter does."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def embedded_tokenizer_fields():
    from tokenmill.model.embedded import embedded_model_path
    from tokenmill.model.gguf_loader import GGUFFile

    fields = GGUFFile(embedded_model_path()).fields
    return {k: fields[k].contents() for k in fields if k.startswith("tokenizer.")}


def write_family_gguf(
    hf_model, family: str, path: Path, tokenizer_fields: dict, quantize: str | None
) -> None:
    import gguf
    import numpy as np

    arch, c = GGUF_ARCH.get(family, family), hf_model.config
    layer_names = {**_GGUF_LAYER, **_GGUF_LAYER_BY_ARCH.get(arch, {})}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary = int(head_dim * (c.rope_parameters or {}).get("partial_rotary_factor", 1.0))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: per layer type
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(rotary)
    if getattr(c, "sliding_window", None) and family in ("phi3", "gemma3"):
        writer.add_sliding_window(c.sliding_window)
    writer.add_tokenizer_model(tokenizer_fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(tokenizer_fields["tokenizer.ggml.pre"])
    writer.add_token_list(tokenizer_fields["tokenizer.ggml.tokens"])
    writer.add_token_merges(tokenizer_fields["tokenizer.ggml.merges"])
    writer.add_token_types(tokenizer_fields["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(tokenizer_fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(tokenizer_fields["tokenizer.ggml.eos_token_id"])
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1  # as llama.cpp's converter writes Gemma's norms: the multiplier itself
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            out = f"blk.{layer}.{layer_names[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                array = _llama_cpp_permute(array, c.num_attention_heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                array = _llama_cpp_permute(array, c.num_key_value_heads)
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if quantize and array.ndim == 2 and array.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[quantize]
            writer.add_tensor(out, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(out, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ~20 s each on 2 Zen 3 cores (gguf's reader parses the 49k-token vocabulary field by field, four times a test):
# qwen2 runs by default, the other families with the slow tests (CI runs both)
@pytest.mark.parametrize(
    "family", [f if f == "qwen2" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(GGUF_ARCH)]
)
def test_gguf_of_each_family_matches_its_safetensors(
    family: str, tokenizer_files: Path, embedded_tokenizer_fields, tmp_path: Path
) -> None:
    hf_model = build_hf(family, seed=8)
    from_dir = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path / "dir")), device="cpu")
    f32_path = tmp_path / f"{family}-f32.gguf"
    write_family_gguf(hf_model, family, f32_path, embedded_tokenizer_fields, quantize=None)
    from_gguf = load_model(str(f32_path), device="cpu")
    assert from_gguf.config.model_type == family
    for field in ("qkv_bias", "qk_norm", "rotary_dim", "head_dim", "tie_word_embeddings", "sliding_window"):
        assert getattr(from_gguf.config, field) == getattr(from_dir.config, field), field
    batch = prompts([3, 17, 30], seed=9)
    text = "The capital of France is Paris."
    assert from_gguf.tokenizer.encode(text) == from_dir.tokenizer.encode(text)
    assert_flat_batch_matches(from_gguf.model, from_gguf.config, hf_model, batch, block_size=4)
    # the same file with Q8_0 projections: kept as blocks on the exact path, equal to the file dequantized
    q8_path = tmp_path / f"{family}-q8_0.gguf"
    write_family_gguf(hf_model, family, q8_path, embedded_tokenizer_fields, quantize="Q8_0")
    kept, dequantized = (
        load_model(str(q8_path), device="cpu", quantization="gguf"),
        load_model(str(q8_path), device="cpu", quantization="fp32"),
    )
    assert kept.quantization == "gguf"
    from test_model_vs_hf import PagedRunner

    a = PagedRunner(kept.model, kept.config, 64, 4).step(dict(enumerate(batch)))
    b = PagedRunner(dequantized.model, dequantized.config, 64, 4).step(dict(enumerate(batch)))
    assert (a - b).abs().max() < 1e-3


def test_sliding_window_releases_blocks_and_keeps_generate_tokens(
    tokenizer_files: Path, tmp_path: Path
) -> None:
    """Mistral, window 8, blocks of 4, a 40-token prompt and 40 new tokens: the request never holds more than
    the blocks its window spans (plus the one being filled), and the tokens are still transformers' own."""
    hf_model = build_hf("mistral", seed=10, sliding_window=8)
    loaded = load_model(str(save_dir(hf_model, tokenizer_files, tmp_path)), device="cpu")
    engine = Engine(loaded=loaded, device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    prompt = prompts([40], seed=11)[0]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    most_held, tokens = 0, []
    while engine.has_unfinished():
        result = engine.step()
        engine.check_integrity()
        most_held = max(most_held, engine.num_total_blocks - engine.num_free_blocks)
        for delta in result.deltas:
            tokens += delta.new_token_ids
    assert most_held <= 8 // 4 + 16 // 4 + 1  # the window, one chunk of 16 new tokens, a partial block
    assert engine.num_free_blocks == engine.num_total_blocks
    with torch.inference_mode():
        expected = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 40, dtype=torch.long), do_sample=False,
            max_new_tokens=40, min_new_tokens=40, pad_token_id=0,
        )[0, 40:].tolist()  # fmt: skip
    assert tokens == expected, request_id


# A template in the shape of Qwen2.5 / Qwen3's (written here, not copied): tools as JSON in a system block,
# a namespace scanned over the reversed history, string tests and methods, tool calls and tool responses.
QWEN_STYLE_TEMPLATE = """
{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{%- elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') and ns.last_query == messages|length - 1 %}
{%- set ns.last_query = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
<|im_start|>assistant
{{ content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{%- endif %}"""


def test_qwen_style_chat_template_with_tools_renders_as_transformers(
    tokenizer_files: Path, tmp_path: Path
) -> None:
    hf_model = build_hf("qwen3", seed=12)
    model_dir = save_dir(hf_model, tokenizer_files, tmp_path)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": QWEN_STYLE_TEMPLATE})
    )
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    loaded = load_model(str(model_dir), device="cpu")
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
              "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>look it up</think>\nChecking.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "user", "content": "And Rome?"},
    ]  # fmt: skip
    ours = loaded.tokenizer.apply_chat_template(messages, tools=tools)
    theirs = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "<tool_response>" in ours and "look it up" not in ours


def test_qwen25_128k_configuration_loads_with_its_scaled_context() -> None:
    """Qwen2.5's documented long-context setting: max_position_embeddings stays 32,768, rope_scaling adds YaRN
    with factor 4 (4.x's "type" key): 131,072 positions, as vLLM derives them."""
    from tokenmill.model.config import LlamaConfig

    base = build_hf("qwen2").config.to_dict()
    scaling = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    config = LlamaConfig.from_hf_dict({**base, "max_position_embeddings": 32768, "rope_scaling": scaling})
    assert config.max_position_embeddings == 131072
    assert config.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": None,
        "beta_fast": None, "beta_slow": None, "mscale": None, "mscale_all_dim": None, "truncate": None,
    }  # fmt: skip
