"""The C++ CPU kernels (``model/csrc``) against float64 or plain-torch references, for every variant this CPU
executes (the ``kernel_variant`` fixture: avx512, avx2 and base on an AVX-512 machine, avxvnni too where the CPU
has AVX-VNNI, avx2 and base on an AVX2 one). A variant that this CPU runs and that is not built fails here rather
than skipping.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_model, tiny_config

from tokenmill.model import kv_format
from tokenmill.model.attention import write_kv
from tokenmill.model.backend import TorchBackend
from tokenmill.model.cpu import kernels as cpu_kernels
from tokenmill.model.cpu.backend import CpuKernelBackend
from tokenmill.model.cpu.packing import attach_cpu_kernels
from tokenmill.model.llama import LlamaForCausalLM, apply_rope
from tokenmill.model.lora import LoRASlots, StepLoRA
from tokenmill.model.quant import Int8Linear, quantize_model_int8


@pytest.fixture
def ops(kernel_variant):
    return kernel_variant


# (rows, out, in): the model's shapes, tails in every dimension, no rows, a 64-row batch, and in beyond one
# int32 flush of the int8 path (2,048-8,192 inputs by variant)
MATMUL_SHAPES = [
    (1, 960, 576),
    (3, 7, 19),
    (5, 13, 576),
    (9, 3072, 576),
    (2, 576, 1536),
    (64, 576, 1536),
    (1, 1, 1),
    (0, 5, 16),
    (2, 9, 5000),
    (1, 4, 8200),
    (2, 5, 16500),
]


@pytest.mark.parametrize(("num_rows", "out_features", "in_features"), MATMUL_SHAPES)
def test_small_linear_int8_within_the_int16_rounding_bound(ops, num_rows, out_features, in_features) -> None:
    """Inputs are rounded to int16 per row (error <= max|x| / 65534 each), the rest is exact."""
    gen = torch.Generator().manual_seed(in_features + 1)
    x = torch.randn(num_rows, in_features, generator=gen)
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    s = torch.rand(out_features, generator=gen)
    expected = (x.double() @ q.double().T) * s.double()
    bound = (x.abs().amax(1, keepdim=True).double() / 65534) * (q.double().abs().sum(1) * s.double())[None, :]
    error = (ops.small_linear(x, q, s).double() - expected).abs()
    assert (error <= bound + 1e-5 * expected.abs() + 1e-6).all()


@pytest.mark.parametrize("weight", [127, -128])
def test_small_linear_int8_does_not_overflow(ops, weight: int) -> None:
    x = torch.full((1, 20000), -3.0)  # every input at its row's maximum: int16 value -32767
    q = torch.full((2, 20000), weight, dtype=torch.int8)
    out = ops.small_linear(x, q, torch.ones(2))
    torch.testing.assert_close(out, torch.full((1, 2), -3.0 * weight * 20000), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("num_rows", "out_features", "in_features"), [*MATMUL_SHAPES, (17, 33, 64), (200, 96, 40)]
)
def test_panel_linear_matches_float64(ops, num_rows: int, out_features: int, in_features: int) -> None:
    """Every row count goes through its own register-block split; columns past a whole panel are masked."""
    gen = torch.Generator().manual_seed(in_features + 2)
    x = torch.randn(num_rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    panels = ops.pack_panels(w)
    width = ops.panel_width()
    assert width == {"avx512": 32, "avxvnni": 16, "avx2": 16, "base": 8}[ops.isa()]
    assert panels.shape == (-(-out_features // width), in_features, width)
    out = ops.panel_linear(x, panels, out_features)
    expected = x.double() @ w.double().T
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * in_features**0.5)


def test_panel_linear_rejects_bad_input(ops) -> None:
    width = ops.panel_width()
    panels = ops.pack_panels(torch.randn(width + 8, 8))  # two panels
    with pytest.raises(RuntimeError, match="N does not match"):
        ops.panel_linear(torch.randn(2, 8), panels, 2 * width + 6)
    with pytest.raises(RuntimeError, match="features"):
        ops.panel_linear(torch.randn(2, 9), panels, width + 8)
    with pytest.raises(RuntimeError, match="panels"):
        ops.panel_linear(torch.randn(2, 8), torch.randn(40, 8), 40)


def test_small_linear_rejects_bad_input(ops) -> None:
    with pytest.raises(RuntimeError, match="must be int8"):
        ops.small_linear(torch.randn(1, 4), torch.zeros(2, 4), torch.ones(2))
    with pytest.raises(RuntimeError, match="scale"):
        ops.small_linear(torch.randn(1, 4), torch.zeros(2, 4, dtype=torch.int8), torch.ones(3))
    with pytest.raises(RuntimeError, match="shapes"):
        ops.small_linear(torch.randn(1, 4), torch.zeros(2, 5, dtype=torch.int8), torch.ones(2))


def test_rms_norm_and_fused_residual_add(ops) -> None:
    gen = torch.Generator().manual_seed(0)
    x, delta, w = torch.randn(37, 576, generator=gen), torch.randn(37, 576, generator=gen), torch.rand(576)
    eps = 1e-5

    def reference(t):
        return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    torch.testing.assert_close(ops.rms_norm(x, w, eps), reference(x), rtol=1e-5, atol=1e-5)
    residual = x.clone()
    normed = ops.add_rms_norm_(residual, delta, w, eps)
    torch.testing.assert_close(residual, x + delta)  # updated in place
    torch.testing.assert_close(normed, reference(x + delta), rtol=1e-5, atol=1e-5)


def test_silu_mul_matches_torch_over_a_wide_range(ops) -> None:
    gate = torch.cat([torch.linspace(-100, 100, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0])])
    gate = gate[: gate.numel() // 2 * 2]
    up = torch.randn_like(gate)
    gate_up = torch.stack([gate, up]).reshape(1, -1)  # one row: gate | up
    out = ops.silu_mul(gate_up.reshape(1, -1))
    torch.testing.assert_close(out[0], F.silu(gate) * up, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize(
    "kv_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
)
def test_rope_write_kv_matches_torch(ops, kv_dtype: torch.dtype) -> None:
    """Rotated q and k, and k and v stored in the cache's format, against torch's apply_rope and write_kv: V (not
    rotated) in the same bytes, K to one step of the format where the rotation's last fp32 bit moved a rounding."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, num_tokens = 9, 3, 64, 11
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 50
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(40, generator=gen)[:num_tokens]
    row = kv_format.row_width(head_dim, kv_dtype)
    caches = [torch.zeros(5, 8, num_kv_heads, row, dtype=kv_dtype) for _ in range(4)]
    q = ops.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, num_heads, num_kv_heads)
    q_ref, k_ref, v_ref = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q_ref = apply_rope(q_ref.view(num_tokens, num_heads, head_dim), cos[:, None], sin[:, None])
    k_ref = apply_rope(k_ref.view(num_tokens, num_kv_heads, head_dim), cos[:, None], sin[:, None])
    write_kv(caches[2], caches[3], k_ref, v_ref.view(num_tokens, num_kv_heads, head_dim), slots)
    torch.testing.assert_close(q, q_ref)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    k_got, k_want = kv_format.decode(caches[0]).double(), kv_format.decode(caches[2]).double()
    if kv_dtype == torch.float32:
        torch.testing.assert_close(k_got, k_want)
    else:
        step = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float8_e4m3fn: 2.0**-3}
        if kv_dtype == torch.int8:
            bound = k_want.abs().amax(dim=-1, keepdim=True) / 127 * 1.01 + 1e-6
        else:
            bound = (k_want.abs() * step[kv_dtype]).clamp_min(2.0**-9) * 1.01
        assert ((k_got - k_want).abs() <= bound).all()
        assert (caches[0].view(torch.uint8) == caches[2].view(torch.uint8)).float().mean() > 0.98


# --- the whole decode stack against the eager forward ------------------------------------------------
def _tiny_model(seed: int) -> LlamaForCausalLM:
    config = tiny_config(
        vocab_size=100,
        hidden_size=192,
        intermediate_size=256,
        num_attention_heads=6,
        head_dim=64,  # the register attention kernel
        max_position_embeddings=512,
    )
    return random_model(config, seed)


def _decode_step(
    model: LlamaForCausalLM, num_rows: int, seed: int, kv_dtype: torch.dtype = torch.float32, lora: Any = None
):
    """Random caches (of ``kv_dtype``), then one decode token per row over shuffled block tables (``lora``: the
    step's adapters, ``model.lora.StepLoRA``): ``(logits, caches)``."""
    rng = random.Random(seed)
    config, block_size = model.config, 16
    lens = [rng.randint(1, 90) for _ in range(num_rows)]
    free = list(range(num_rows * 8))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    gen = torch.Generator().manual_seed(seed)
    shape = (num_rows * 8, block_size, config.num_key_value_heads, config.head_dim)
    caches = [
        (
            kv_format.encode(torch.randn(shape, generator=gen), kv_dtype),
            kv_format.encode(torch.randn(shape, generator=gen), kv_dtype),
        )
        for _ in model.model.layers
    ]
    meta = model.plan_attention([1] * num_rows, lens, tables, block_size)
    meta.lora = lora
    input_ids = torch.randint(0, config.vocab_size, (num_rows,), generator=gen)
    positions = torch.tensor([n - 1 for n in lens])
    with torch.inference_mode():
        hidden = model(input_ids, positions, meta, caches)
        return model.compute_logits(hidden), caches


def _torch_reference(model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> LlamaForCausalLM:
    """The same weights as plain fp32 torch modules (int8 layers dequantized), with every C++ kernel off."""
    monkeypatch.setattr(
        cpu_kernels, "loaded", lambda: cpu_kernels.LoadedKernels(None, None, "off", "", frozenset())
    )
    reference = random_model(model.config, seed=0)
    ref_modules = dict(reference.named_modules())
    with torch.no_grad():
        for name, layer in model.named_modules():
            weight = layer.dequantize() if isinstance(layer, Int8Linear) else getattr(layer, "weight", None)
            if name == "lm_head":  # int8 copy of a tied head: the reference gets it as its own head
                reference.lm_head = torch.nn.Linear(
                    model.config.hidden_size, model.config.vocab_size, bias=False
                )
                reference.lm_head.weight.copy_(weight)
            elif isinstance(weight, torch.Tensor):
                ref_modules[name].weight.copy_(weight)
    assert type(reference.compute_backend()) is TorchBackend  # never prepared: plain torch
    return reference


@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize("int8", [False, True])
def test_decode_stack_matches_the_pure_torch_forward(
    kernel_variant, monkeypatch: pytest.MonkeyPatch, num_rows: int, int8: bool
) -> None:
    """The C++ decode stack (on its own matmuls) against the eager forward with no C++ kernel at all."""
    model = _tiny_model(seed=num_rows)
    if int8:
        quantize_model_int8(model)
    backend = CpuKernelBackend(model.config.head_dim)
    backend.prepare(model)
    if kernel_variant.isa() == "base":  # the portable build runs no matmul, so no stack
        assert backend.decode_stack is None
        return
    assert backend.decode_stack is not None
    stacked, stacked_caches = _decode_step(model, num_rows, seed=num_rows)
    reference = _torch_reference(model, monkeypatch)
    plain, plain_caches = _decode_step(reference, num_rows, seed=num_rows)
    # int8: the stack rounds activations to int16 per row (max|x| / 65534 per element); fp32 differs only in
    # summation order.
    tol = 2e-3 if int8 else 1e-4
    torch.testing.assert_close(stacked, plain, rtol=tol, atol=tol)
    for (k1, v1), (k2, v2) in zip(stacked_caches, plain_caches):  # the same new K/V landed in the same slots
        torch.testing.assert_close(k1, k2, rtol=tol, atol=tol)
        torch.testing.assert_close(v1, v2, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_rows", [1, 5, 11])
def test_decode_stack_with_adapters_matches_the_torch_forward(
    kernel_variant, monkeypatch: pytest.MonkeyPatch, num_rows: int
) -> None:
    """The decode stack adding each row's LoRA delta after every projection (``forward_lora``: rows of two
    adapters and of the base model, more rows of one slot than a kernel block holds at 11) against the eager
    forward with no C++ kernel, whose adapters go through torch (``StepLoRA`` without a kernel)."""
    model = _tiny_model(seed=7)
    backend = CpuKernelBackend(model.config.head_dim)
    backend.prepare(model)
    if kernel_variant.isa() == "base":  # no stack on the portable build
        assert backend.decode_stack is None
        return
    slots = LoRASlots(model.config, max_loras=2, max_rank=4)
    gen = torch.Generator().manual_seed(num_rows)
    with torch.no_grad():
        for weights in (*slots.a.values(), *slots.b.values()):
            weights.copy_(torch.randn(weights.shape, generator=gen) * 0.1)
    token_slots = [0] * 9 + [1, -1] if num_rows == 11 else [[0, -1, 1][i % 3] for i in range(num_rows)]
    kernel = cpu_kernels.lora_kernel()
    assert kernel is not None
    step = StepLoRA(slots, token_slots, kernel)
    probe = model.plan_attention([1] * num_rows, [5] * num_rows, [[0]] * num_rows, 16)
    probe.lora = step
    assert backend.fused_step(probe) is not None  # the step runs in the stack, adapters and all
    stacked, stacked_caches = _decode_step(model, num_rows, seed=num_rows, lora=step)
    reference = _torch_reference(model, monkeypatch)
    plain, plain_caches = _decode_step(reference, num_rows, seed=num_rows, lora=StepLoRA(slots, token_slots))
    torch.testing.assert_close(stacked, plain, rtol=1e-4, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(stacked_caches, plain_caches):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-4)
    base, _ = _decode_step(reference, num_rows, seed=num_rows)
    adapted = [i for i, s in enumerate(token_slots) if s >= 0]
    assert (stacked[adapted] - base[adapted]).abs().amax() > 1e-2  # the adapters changed those rows
    untouched = [i for i, s in enumerate(token_slots) if s < 0]
    torch.testing.assert_close(stacked[untouched], base[untouched], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_decode_stack_on_a_16_bit_kv_cache(kernel_variant, monkeypatch: pytest.MonkeyPatch, kv_dtype) -> None:
    """The decode stack writes each new K and V rounded to the cache's dtype and attends over the stored values:
    against the eager forward (torch's write_kv rounds with .to(), its attention reads the cache as fp32). The new
    keys agree to fp32's summation order, so after rounding they agree to one unit in the last 16-bit place."""
    model = _tiny_model(seed=2)
    backend = CpuKernelBackend(model.config.head_dim)
    backend.prepare(model)
    if kernel_variant.isa() == "base":
        return
    stacked, stacked_caches = _decode_step(model, 4, seed=2, kv_dtype=kv_dtype)
    reference = _torch_reference(model, monkeypatch)
    plain, plain_caches = _decode_step(reference, 4, seed=2, kv_dtype=kv_dtype)
    torch.testing.assert_close(stacked, plain, rtol=1e-3, atol=1e-3)
    ulp = 2.0**-10 if kv_dtype == torch.float16 else 2.0**-7
    for (k1, v1), (k2, v2) in zip(stacked_caches, plain_caches):
        assert k1.dtype == kv_dtype
        for a, b in ((k1, k2), (v1, v2)):
            diff = (a.float() - b.float()).abs()
            assert (diff <= ulp * b.float().abs().clamp_min(1e-3) * 1.01).all()
            assert (a == b).float().mean() > 0.99  # nearly all bit for bit


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8])
def test_decode_stack_on_an_8_bit_kv_cache(kernel_variant, monkeypatch: pytest.MonkeyPatch, kv_dtype) -> None:
    """As the 16-bit test: the decode stack's new K and V encoded as torch's write_kv encodes them (fp8: torch's
    saturating cast; int8: codes and a scale per token and head), to one step of the format where fp32's summation
    order moved a value across a rounding boundary, and attention over the stored values alike."""
    model = _tiny_model(seed=2)
    backend = CpuKernelBackend(model.config.head_dim)
    backend.prepare(model)
    if kernel_variant.isa() == "base":
        return
    stacked, stacked_caches = _decode_step(model, 4, seed=2, kv_dtype=kv_dtype)
    reference = _torch_reference(model, monkeypatch)
    plain, plain_caches = _decode_step(reference, 4, seed=2, kv_dtype=kv_dtype)
    torch.testing.assert_close(stacked, plain, rtol=2e-3, atol=2e-3)
    for (k1, v1), (k2, v2) in zip(stacked_caches, plain_caches):
        assert k1.dtype == kv_dtype and k1.shape[-1] == kv_format.row_width(model.config.head_dim, kv_dtype)
        for a, b in ((k1, k2), (v1, v2)):
            values = kv_format.decode(b).double()
            if kv_dtype == torch.int8:  # one code: the row's scale (its magnitude / 127)
                step = values.abs().amax(dim=-1, keepdim=True) / 127
            else:  # e4m3: 3 mantissa bits, subnormals 2^-9 apart
                step = (values.abs() * 2.0**-3).clamp_min(2.0**-9)
            assert ((kv_format.decode(a).double() - values).abs() <= step * 1.01 + 1e-7).all()
            assert (a == b).float().mean() > 0.99  # nearly all bit for bit


def test_torch_fallback_matches_the_kernels(kernel_variant, monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager forward with every C++ kernel off (CUDA, TOKENMILL_NO_CPP=1) gives the same logits as each
    variant's path (the decode stack where the variant has one)."""
    model = _tiny_model(seed=5)
    CpuKernelBackend(model.config.head_dim).prepare(model)
    with_kernels, _ = _decode_step(model, 4, seed=5)
    monkeypatch.setattr(cpu_kernels, "_module", lambda: None)
    monkeypatch.setattr(cpu_kernels, "_matmul_module", lambda: None)
    plain = _tiny_model(seed=5)
    assert attach_cpu_kernels(plain) == 0
    TorchBackend("cpu").prepare(plain)
    without, _ = _decode_step(plain, 4, seed=5)
    torch.testing.assert_close(with_kernels, without, rtol=1e-4, atol=1e-4)
