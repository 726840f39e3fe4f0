"""A tiny random Llama written as a K-quant / mixed-type GGUF with the ``gguf`` package: loaded with its blocks
kept (``quantization="gguf"``, the default for such a file) it gives the logits of its dequantized fp32 twin
(``quantization="fp32"``, whose weights test_loader_errors checks against ``gguf``'s dequantize), through the
flat-batch prefill and the decode stack, on every kernel variant."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from test_gguf_blocks import round_activations
from tiny_models import random_blocks

from tokenmill.model import arithmetic, gguf_loader
from tokenmill.model.gguf_blocks import QuantizedWeight
from tokenmill.model.loader import LoadedModel, allocate_kv_cache, load_model
from tokenmill.model.quant import QuantizedEmbedding, QuantizedLinear

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 64  # K-quant rows: multiples of 256
HEAD_DIM = HIDDEN // HEADS
# tensor kind -> type: Q4_K_M-like (q/k Q4_K, v Q6_K in one fused qkv), the rest spread over every kept type
TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_K",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q8_0",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "Q4_1",
}
_QUANTIZERS = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q8_0",
    "MXFP4",
)  # the gguf package quantizes these; K-quants get random valid blocks


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))


def write_gguf(path: Path, types: dict[str, str], tied: bool = False, seed: int = 0) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    tokens = (
        [chr(ord("a") + i) for i in range(26)] + ["<s>", "</s>", "xy"] + [f"t{i}" for i in range(VOCAB - 29)]
    )
    writer.add_token_list(tokens)
    writer.add_token_merges(["x y"])
    writer.add_token_types([1] * 26 + [3, 3] + [1] * (VOCAB - 28))
    writer.add_bos_token_id(26)
    writer.add_eos_token_id(27)
    rng = np.random.default_rng(seed)
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }
    tensors: list[tuple[str, str, tuple[int, int]]] = [("token_embd.weight", "token_embd", (VOCAB, HIDDEN))]
    if not tied:
        tensors.append(("output.weight", "output", (VOCAB, HIDDEN)))
    for layer in range(LAYERS):
        tensors += [(f"blk.{layer}.{kind}.weight", kind, shape) for kind, shape in shapes.items()]
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for layer in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(
                f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            )
    for i, (name, kind, (rows, cols)) in enumerate(tensors):
        type_name = types.get(kind, "F32")
        if type_name in ("F32", "F16"):
            array = (0.05 * rng.standard_normal((rows, cols))).astype(
                np.float32 if type_name == "F32" else np.float16
            )
            writer.add_tensor(name, array)
            continue
        qtype = gguf.GGMLQuantizationType[type_name]
        if type_name in _QUANTIZERS:
            data = gguf.quants.quantize((0.05 * rng.standard_normal((rows, cols))).astype(np.float32), qtype)
        else:
            data = random_blocks(type_name, rows, cols, seed=seed * 1000 + i)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.inference_mode()
def prefill_then_decode(loaded: LoadedModel, prompts: list[list[int]], num_decode: int) -> list[torch.Tensor]:
    """Logits of every prompt's last token (one flat prefill batch), then of ``num_decode`` greedy decode steps
    of all rows together (the decode stack's path where one is built)."""
    model, config, block_size = loaded.model, loaded.config, 4
    kv = allocate_kv_cache(config, 64, block_size, torch.float32, "cpu")
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    meta = model.plan_attention(lens, lens, tables, block_size)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    hidden = model(ids, positions, meta, kv)
    logits = model.compute_logits(hidden[torch.tensor(meta.query_start_loc[1:]) - 1])
    out = [logits]
    for _ in range(num_decode):
        ids = logits.argmax(-1)
        positions = torch.tensor(lens)
        lens = [n + 1 for n in lens]
        meta = model.plan_attention([1] * len(prompts), lens, tables, block_size)
        logits = model.compute_logits(model(ids, positions, meta, kv))
        out.append(logits)
    return out


PROMPTS = [[3, 7, 1, 9, 30], [5] * 13, [40, 41, 42]]


def kept_and_twin(path: Path, types: dict[str, str]) -> tuple[LoadedModel, LoadedModel]:
    """A tiny GGUF of ``types`` loaded with its blocks kept on the exact path, and dequantized at load (the
    reference)."""
    write_gguf(path, types)
    kept = load_model(str(path), device="cpu", quantization="gguf")
    assert kept.quantization == "gguf"
    return kept, load_model(str(path), device="cpu", quantization="fp32")


def test_kept_blocks_match_the_dequantized_twin(kernel_variant, tmp_path: Path) -> None:
    kept, twin = kept_and_twin(tmp_path / "tiny-mixed.gguf", TYPES)
    qkv = kept.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.weight.type_summary() == "4bit/g32+4bit/g32+6bit/g16"
    assert isinstance(kept.model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(kept.model.lm_head, QuantizedLinear)
    assert twin.quantization == "fp32" and not isinstance(twin.model.lm_head, QuantizedLinear)
    if kernel_variant.isa() != "base":
        assert kept.model.backend.decode_stack is not None
    for step, (a, b) in enumerate(
        zip(prefill_then_decode(kept, PROMPTS, 3), prefill_then_decode(twin, PROMPTS, 3))
    ):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0, msg=f"step {step}")
    assert kept.weight_bytes < twin.weight_bytes / 3


# the block types added for files whose rows do not divide into Q4_K's 256 (Qwen2.5-0.5B: Q5_0) and the low-bit
# ones (Q2_K_M, Q3_K_M, IQ4 files)
LOW_BIT_TYPES = {
    "attn_q": "Q5_0",
    "attn_k": "Q5_1",
    "attn_v": "IQ4_NL",
    "attn_output": "Q3_K",
    "ffn_gate": "Q2_K",
    "ffn_up": "IQ4_XS",
    "ffn_down": "Q5_1",
    "token_embd": "Q5_0",
    "output": "Q2_K",
}


def test_low_bit_types_match_the_dequantized_twin(kernel_variant, tmp_path: Path) -> None:
    kept, twin = kept_and_twin(tmp_path / "tiny-low-bit.gguf", LOW_BIT_TYPES)
    qkv = kept.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.weight.type_summary() == "5bit/g32+5bit/g32+8bit/g32"
    assert kept.model.model.layers[0].mlp.gate_up_proj.weight.type_summary() == "5bit/g16+8bit/g32"
    for step, (a, b) in enumerate(
        zip(prefill_then_decode(kept, PROMPTS, 3), prefill_then_decode(twin, PROMPTS, 3))
    ):
        scale = b.abs().max().clamp_min(1.0)
        torch.testing.assert_close(a / scale, b / scale, atol=2e-5, rtol=0, msg=f"step {step}")


def test_gguf_q8_on_a_mixed_file(kernel_variant, tmp_path: Path) -> None:
    """``quantization="gguf-q8"`` on a Q4_K / Q6_K file: the 4-bit parts take the quad layout, the Q6_K ones byte
    quads, inside the same fused matmul, Q8_0 projections wide byte quads; the decode stack gives the eager forward's logits bit for bit; and the
    logits point the exact path's way (the kernel's own arithmetic is pinned in test_gguf_blocks.py)."""
    path = tmp_path / "tiny-mixed.gguf"
    write_gguf(path, TYPES)
    q8 = load_model(str(path), device="cpu", quantization="gguf-q8")
    assert q8.quantization == "gguf-q8"
    qkv = q8.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.type_summary() == "4bit/g32/x8+4bit/g32/x8+6bit/g16/x8"
    # Q4_0 gate and Q8_0 up (wide byte quads: a file not measured gets them, as llama.cpp computes Q8_0)
    assert q8.model.model.layers[0].mlp.gate_up_proj.weight.type_summary() == "4bit/g32/x8+8bit/g32/x8"
    exact = load_model(str(path), device="cpu", quantization="gguf")
    with_stack = prefill_then_decode(q8, PROMPTS, 3)
    stack, q8.model.backend.decode_stack = q8.model.backend.decode_stack, None
    eager = prefill_then_decode(q8, PROMPTS, 3)
    q8.model.backend.decode_stack = stack
    for a, b in zip(with_stack, eager, strict=True):
        assert torch.equal(a, b)
    # the prefill's logits (later steps feed each path its own argmax)
    a, b = with_stack[0], prefill_then_decode(exact, PROMPTS, 0)[0]
    # a random model's activations carry outliers that round the rest of their group coarsely: measured cosine
    # 0.981, 1.000, 1.000 for the three prompts (the embedded model's KL is in test_gguf_q8.py)
    assert (torch.nn.functional.cosine_similarity(a, b, dim=-1) > 0.95).all()


def test_gguf_q4_rounds_every_type_to_4_bits(kernel_variant, tmp_path: Path) -> None:
    """``quantization="gguf-q4"`` (a draft model's default) on the low-bit file: every projection becomes 4-bit
    groups of 32 in the 8-bit-activation layout, the embedding and the head keep the file's types, fewer bytes in
    all, and the logits still point the exact path's way (approximate weights: no bit-for-bit claim)."""
    path = tmp_path / "tiny-low-bit.gguf"
    write_gguf(path, LOW_BIT_TYPES)
    q4 = load_model(str(path), device="cpu", quantization="gguf-q4")
    exact = load_model(str(path), device="cpu", quantization="gguf")
    assert q4.quantization == "gguf-q4"
    layer = q4.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.type_summary() == "4bit/g32/x8+4bit/g32/x8+4bit/g32/x8"
    assert layer.mlp.gate_up_proj.weight.type_summary() == "4bit/g32/x8+4bit/g32/x8"
    # the head's Q2_K blocks as they are (five-bit quads: the same weights, times 8-bit activations)
    assert exact.model.lm_head.weight.type_summary() == "5bit/g16"
    assert q4.model.lm_head.weight.type_summary() == "5bit/g16/x8"
    assert torch.equal(q4.model.lm_head.weight.dequantize(), exact.model.lm_head.weight.dequantize())
    embed, exact_embed = q4.model.model.embed_tokens, exact.model.model.embed_tokens
    table = QuantizedWeight(embed.data, embed.meta)
    assert (
        table.type_summary() == "5bit/g32/x8"
    )  # the file's Q5_0 table in five-bit quads, looked up as it was
    assert torch.equal(table.dequantize(), QuantizedWeight(exact_embed.data, exact_embed.meta).dequantize())
    assert q4.weight_bytes < exact.weight_bytes
    a, b = prefill_then_decode(q4, PROMPTS, 0)[0], prefill_then_decode(exact, PROMPTS, 0)[0]
    assert (torch.nn.functional.cosine_similarity(a, b, dim=-1) > 0.9).all()
    # a second load maps the q4 blocks cache (its own file beside the exact and q8 ones)
    again = load_model(str(path), device="cpu", quantization="gguf-q4")
    torch.testing.assert_close(prefill_then_decode(again, PROMPTS, 0)[0], a, atol=0, rtol=0)


def test_tied_head_shares_the_embedding_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tiny-tied.gguf"
    write_gguf(path, TYPES, tied=True)
    kept = load_model(str(path), device="cpu", quantization="gguf")
    embed, head = kept.model.model.embed_tokens, kept.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.data.data_ptr() == embed.data.data_ptr()
    twin = load_model(str(path), device="cpu", quantization="fp32")
    a, b = prefill_then_decode(kept, PROMPTS, 1), prefill_then_decode(twin, PROMPTS, 1)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-4, rtol=0)


def test_wide_quads_for_q8_0_unless_the_file_keeps_them_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gguf-q8 on a file with a tied Q8_0 table: the table (the head) in wide byte quads, times 8-bit activations,
    its lookups the file's rows; with the file's Q8_0 tensors kept exact (``arithmetic.wide_quads`` False: a
    measured file outside the rule that way), the head is the exact path's, bit for bit, from its own cache entry."""
    path = tmp_path / "tiny-tied.gguf"
    write_gguf(path, TYPES, tied=True)
    exact = load_model(str(path), device="cpu", quantization="gguf")
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    q8 = load_model(str(path), device="cpu", quantization="gguf-q8")
    head, table = q8.model.lm_head, q8.model.model.embed_tokens
    assert head.weight.type_summary() == "8bit/g32/x8" and head.data.data_ptr() == table.data.data_ptr()
    weights = exact.model.lm_head.weight.dequantize()
    assert torch.equal(head.weight.dequantize(), weights)
    rounded = round_activations(hidden) @ weights.double().T
    scale = (round_activations(hidden).abs() @ weights.double().abs().T).clamp_min(1e-30)
    assert ((head(hidden).double() - rounded).abs() / scale).max() < 1e-5
    monkeypatch.setenv(arithmetic.WIDE_QUADS_ENV, "0")
    narrow = load_model(str(path), device="cpu", quantization="gguf-q8")
    assert narrow.model.lm_head.weight.type_summary() == "8bit/g32"
    assert torch.equal(narrow.model.lm_head(hidden), exact.model.lm_head(hidden))
    assert narrow.model.model.layers[0].mlp.gate_up_proj.weight.type_summary() == "4bit/g32/x8+8bit/g32"
    modes = sorted(
        re.sub(r".*-w\d+-(.+)-v\d+\.safetensors", r"\1", p.name) for p in (tmp_path / "cache").iterdir()
    )
    assert modes == ["exact", "q8", "q8-narrow"], modes


def test_a_dense_part_makes_its_fused_projection_dense(tmp_path: Path) -> None:
    """q in F16 next to Q4_K k and v: the fused qkv is one fp32 matrix (exact, only larger); the rest stays kept."""
    path = tmp_path / "tiny-f16q.gguf"
    write_gguf(path, {**TYPES, "attn_q": "F16"})
    kept = load_model(str(path), device="cpu", quantization="gguf")
    layer = kept.model.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
    twin = load_model(str(path), device="cpu", quantization="fp32")
    torch.testing.assert_close(
        prefill_then_decode(kept, PROMPTS, 0)[0], prefill_then_decode(twin, PROMPTS, 0)[0], atol=2e-4, rtol=0
    )


def test_without_kernels_the_default_dequantizes_and_gguf_still_works(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TYPES)
    from tokenmill.model.cpu import kernels as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "quant_kernels", lambda: None)
    monkeypatch.setattr(
        cpu_kernels, "loaded", lambda: cpu_kernels.LoadedKernels(None, None, "test", "cpu", frozenset())
    )
    assert load_model(str(path), device="cpu").quantization == "fp32"
    torch_path = load_model(
        str(path), device="cpu", quantization="gguf"
    )  # the torch fallback: dequantize per call
    monkeypatch.undo()
    kernels = load_model(str(path), device="cpu", quantization="gguf")
    torch.testing.assert_close(
        prefill_then_decode(torch_path, PROMPTS, 1)[1],
        prefill_then_decode(kernels, PROMPTS, 1)[1],
        atol=2e-4,
        rtol=0,
    )


def test_gguf_mode_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TYPES)
    with pytest.raises(ValueError, match="CPU in float32"):
        load_model(str(path), device="cpu", dtype="bfloat16", quantization="gguf")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        load_model(str(tmp_path), device="cpu", quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(path), device="cpu", quantization="q4")


def test_unsupported_quantized_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny-mxfp4.gguf"
    write_gguf(path, {**TYPES, "ffn_up": "MXFP4"})
    with pytest.raises(ValueError, match="MXFP4"):
        load_model(str(path), device="cpu")
    assert "MXFP4" not in gguf_loader._SUPPORTED_TYPES


@pytest.mark.parametrize("tied", [False, True])
def test_what_a_decode_step_reads_against_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied
) -> None:
    """``tokenmill info --load``'s two numbers: the weights a step reads (every storage but the token embedding's
    table, unless the head is tied to it) and the file's tensor bytes other than the token embedding (the table too
    when the head is tied), each against an independent count."""
    from tokenmill.model.quant import decode_read_bytes, weight_bytes

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-low-bit.gguf"
    write_gguf(path, LOW_BIT_TYPES, tied=tied)
    reader = gguf.GGUFReader(path)
    skip = {"token_embd.weight"} if not tied else set()
    assert gguf_loader.GGUFFile(path).step_bytes() == sum(
        int(t.n_bytes) for t in reader.tensors if t.name not in skip
    )
    loaded = load_model(str(path), device="cpu", quantization="gguf-q8")
    table = loaded.model.model.embed_tokens
    assert isinstance(table, QuantizedEmbedding)
    table_bytes = sum(t.untyped_storage().nbytes() for t in (table.data, table.meta))  # its blocks and layout
    expected = weight_bytes(loaded.model) - (0 if tied else table_bytes)
    assert decode_read_bytes(loaded.model) == expected


def test_the_exact_path_reads_the_bytes_of_llama_cpps_arithmetic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q6_K and Q5_K in their six and five bits on the exact path too: a decode step reads the same bytes on both
    arithmetics (a byte a code, ``quad_bits=8``, reads more: ``test_gguf_blocks``)."""
    from tokenmill.model.quant import decode_read_bytes

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-mixed.gguf"
    write_gguf(path, TYPES)
    exact = load_model(str(path), device="cpu", quantization="gguf")
    rounded = load_model(str(path), device="cpu", quantization="gguf-q8")
    assert decode_read_bytes(exact.model) == decode_read_bytes(rounded.model)
    layer = exact.model.model.layers[0]
    assert layer.mlp.down_proj.weight.type_summary() == "6bit/g16"  # Q6_K
    assert layer.self_attn.o_proj.weight.type_summary() == "5bit/g32"  # Q5_K


def test_a_load_deletes_the_cache_entries_no_load_can_find_again(tmp_path: Path) -> None:
    """Writing an entry prunes the cache: the entries of a removed file and a rewritten one go, a kept file's stay."""
    cache = tmp_path / "cache"
    paths = {name: tmp_path / f"{name}.gguf" for name in ("kept", "removed", "rewritten", "new")}
    for name in ("kept", "removed", "rewritten"):
        write_gguf(paths[name], TYPES)
        load_model(str(paths[name]), device="cpu", quantization="gguf")
        load_model(str(paths[name]), device="cpu", quantization="fp32")
    entries = {p.name for p in cache.glob("gguf-*.safetensors")}
    assert len(entries) == 6  # a blocks entry and a dequantized one each
    paths["removed"].unlink()
    write_gguf(paths["rewritten"], TYPES, seed=1)
    write_gguf(paths["new"], TYPES, seed=2)
    load_model(str(paths["new"]), device="cpu", quantization="gguf")
    left = {p.name for p in cache.glob("gguf-*.safetensors")}
    kept = {n for n in left if gguf_loader.file_identity(paths["kept"]) in n}
    new = {n for n in left if gguf_loader.file_identity(paths["new"]) in n}
    assert len(kept) == 2 and kept <= entries and len(new) == 1
    assert left == kept | new


def test_k_quant_activations_per_super_block_unless_the_file_measured_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gguf-q8 rounds a K-quant's activations with one scale per super-block of 256 (llama.cpp's Q8_K) and those of
    the other types per group of 32; with ``arithmetic.super_block_acts`` False (a measured file outside the rule
    that way) the K-quants take groups of 32 too, from their own cache entry. Checked on the fused qkv (Q4_K q and
    k, Q6_K v) against each rounding's float64 reference."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, TYPES)
    exact = load_model(str(path), device="cpu", quantization="gguf")
    weights = exact.model.model.layers[0].self_attn.qkv_proj.weight.dequantize().double()
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    for env, group, mode in (("1", 256, "q8"), ("0", 32, "q8-g32")):
        monkeypatch.setenv(arithmetic.SUPER_BLOCK_ACTS_ENV, env)
        q8 = load_model(str(path), device="cpu", quantization="gguf-q8")
        qkv = q8.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.type_summary() == "4bit/g32/x8+4bit/g32/x8+6bit/g16/x8"
        rounded = round_activations(hidden, group)
        scale = (rounded.abs() @ weights.abs().T).clamp_min(1e-30)
        assert ((qkv(hidden).double() - rounded @ weights.T).abs() / scale).max() < 1e-5, group
        assert any(
            p.name.endswith(f"-{mode}-v{gguf_loader.BLOCKS_CACHE_VERSION}.safetensors")
            for p in (tmp_path / "cache").iterdir()
        )


@pytest.mark.parametrize("quantization", ["gguf-q8", "gguf", "fp32"])
def test_a_long_steps_mlp_in_row_chunks_equals_it_whole(kernel_variant, tmp_path: Path, quantization) -> None:
    """Twice ``chunk_rows`` rows or more go through the MLP in near-equal chunks of ``chunk_rows`` to twice that:
    every row's output is the one the whole step gives (the kernels' arithmetic does not depend on how many rows
    came with it)."""
    path = tmp_path / "tiny-mixed.gguf"
    write_gguf(path, TYPES)
    mlp = load_model(str(path), device="cpu", quantization=quantization).model.model.layers[0].mlp
    x = torch.randn(200, HIDDEN, generator=torch.Generator().manual_seed(3))
    whole = mlp._forward(x, None, None)
    calls: list[int] = []
    forward = mlp._forward
    mlp._forward = lambda rows, ops, lora: calls.append(rows.shape[0]) or forward(rows, ops, lora)
    mlp.chunk_rows = 64
    chunked = mlp(x)
    assert calls == [66, 67, 67]
    if quantization == "fp32":  # torch's matmul may block its sums by the row count
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(chunked, whole)
    calls.clear()
    mlp.chunk_rows = 101  # fewer than twice: whole
    assert torch.equal(mlp(x), whole) and calls == [200]


class _Recorder:
    """The kernel module, recording which of its functions a forward looked up."""

    def __init__(self, module: Any) -> None:
        self.module, self.names = module, []

    def __getattr__(self, name: str) -> Any:
        self.names.append(name)
        return getattr(self.module, name)


@pytest.mark.parametrize("quantization", ["gguf-q8", "gguf"])
def test_the_mlp_hands_gate_up_to_the_down_projection_whole(
    kernel_variant, tmp_path: Path, quantization
) -> None:
    """With the kernels, a quantized down projection takes gate | up and makes silu(gate) * up itself
    (``quant_linear_silu``): the output is silu_mul's product through the projection, bit for bit, without
    silu_mul's fp32 rows; a down projection without the kernel (torch's dequantize) takes the two steps."""
    path = tmp_path / "tiny-mixed.gguf"
    write_gguf(path, TYPES)
    mlp = load_model(str(path), device="cpu", quantization=quantization).model.model.layers[0].mlp
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(8))
    gate_up = mlp.gate_up_proj(x)
    expected = mlp.down_proj(kernel_variant.silu_mul(gate_up))
    ops = _Recorder(kernel_variant)
    assert torch.equal(mlp._forward(x, ops, None), expected)
    assert "quant_linear_silu" in ops.names and "silu_mul" not in ops.names
    if quantization == "gguf-q8":
        gate_up_rounded = round_activations(kernel_variant.silu_mul(gate_up), 256)
        weights = mlp.down_proj.weight.dequantize().double()
        scale = (gate_up_rounded.abs() @ weights.abs().T).clamp_min(1e-30)
        assert ((expected.double() - gate_up_rounded @ weights.T).abs() / scale).max() < 1e-5
    assert not mlp._down_takes_silu(None)
    mlp.down_proj.kernel = None  # torch's dequantize: the two steps
    ops.names.clear()
    assert torch.equal(mlp._forward(x, ops, None), mlp.down_proj(kernel_variant.silu_mul(gate_up)))
    assert "silu_mul" in ops.names and "quant_linear_silu" not in ops.names
