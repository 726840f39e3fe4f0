"""Weight-only int8: every projection and the LM head hold int8 weights and one scale per output channel.

Decode at batch 1 streams every weight once per token, so it is bound by memory bandwidth; int8 weights
are a quarter of the fp32 bytes. Quantization is symmetric per output row: ``scale = max|w_row| / 127``,
``q = round(w / scale)`` in [-127, 127], so ``|w - q * scale| <= scale / 2`` per element.

Forward on CPU, once the CPU kernel backend has prepared the model (``model/cpu/backend.py``; the loader does it): the
C++ ``small_linear`` kernel (``csrc/small_linear.h``) at every batch size. It rounds the activations to int16
fixed point per row and multiplies with VNNI int16 dot products into exact int32 sums; it reads the int8
weight at ~25-30 GB/s at batch 1 and is 1.5x torch's int8 kernel up to 2,048 rows
(``benchmarks/bench_linear.py``). Quality (``benchmarks/int8_quality.py``, the embedded model against
fp32): NLL of a 376-token text 3.1404 -> 3.1462 nats/token (+0.0058; perplexity +0.6%), top-1 agreement 97.1%,
4 of 16 greedy 32-token continuations identical (this model's greedy output is fragile: bf16 weights give 6).
The first path, ``aten._weight_int8pack_mm`` on bf16 activations, cost +0.0033 nats/token and 96.3% top-1; it is
the fallback without the C++ kernel. In torch 2.13 that kernel is vectorized only for bf16 (fp32 and fp16
inputs run a scalar loop). ``benchmarks/bench_int8_matmul.py`` times it against fp32, against ``torch._int_mm``
on dynamically quantized int8 activations (NLL cost +0.045 nats/token with ``int8_quality.py --int-mm``) and
against dequantize-then-matmul. Scales are kept on the bf16 grid, so the kernel's bf16 copy of them is exact.
Elsewhere (CUDA) the forward dequantizes: cast the int8 weight to the compute dtype, matmul, scale the output
columns (no bandwidth win; correct in bf16).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.config import LlamaConfig
from tokenmill.model.gguf_blocks import Groups, QuantizedWeight
from tokenmill.model.llama import LlamaForCausalLM, fuse_hf_state_dict

# fn(x [M, K] float32, weight [N, K] int8, scale [N] float32) -> [M, N] (cpu.kernels.small_linear_kernel)
SmallLinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The one dtype aten._weight_int8pack_mm's CPU kernel is fast in (activations and scales alike).
_KERNEL_DTYPE = torch.bfloat16


def quantize_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> (``int8 [out, in]``, ``scales [out]`` in ``dtype``), symmetric per row.

    The scale is rounded to ``dtype`` before the weight is divided by it, and nudged up where rounding made
    ``127 * scale`` fall short of the row's largest magnitude, so ``|w - q * scale| <= scale / 2`` holds for
    the scales actually stored, in bf16 too.
    """
    w32 = weight.detach().float()
    amax = w32.abs().amax(dim=1)  # [out]
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))  # an all-zero row: any scale, q = 0
    scales = (amax / 127).to(dtype)
    short = scales.float() * 127 < amax
    if short.any():
        scales = torch.where(short, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    q = (w32 / scales.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)  # [out, in]
    return q, scales


class Int8Linear(nn.Module):
    """A bias-free linear layer over ``weight_int8 [out, in]`` and per-row ``scales [out]``.

    ``scales`` are in the compute dtype; ``scales_bf16`` is the CPU kernel's copy (not saved in a
    state dict).
    """

    weight_int8: torch.Tensor
    scales: torch.Tensor
    scales_bf16: torch.Tensor
    # Set by cpu.packing.attach_cpu_kernels: every fp32 batch then goes to the C++ kernel.
    small_kernel: SmallLinearKernel | None = None

    def __init__(
        self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError(
                f"weight_int8 must be a 2-D int8 tensor, got {weight_int8.dtype} {weight_int8.dim()}-D"
            )
        if tuple(scales.shape) != (weight_int8.shape[0],):
            raise ValueError(f"scales must have shape ({weight_int8.shape[0]},), got {tuple(scales.shape)}")
        self.out_features, self.in_features = weight_int8.shape
        # Buffers: they follow .to(device); .to(dtype) casts the scales and leaves the int8 weight alone.
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("scales_bf16", scales.to(_KERNEL_DTYPE).contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, dtype: torch.dtype | None = None, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        """Quantize ``weight [out, in]``; scales in ``dtype`` (default: the weight's dtype), on the bf16 grid;
        ``bias`` (kept in its dtype) is added after the matmul."""
        q, scales = quantize_per_channel(weight, _KERNEL_DTYPE)
        return cls(q, scales.to(dtype or weight.dtype), bias)

    def dequantize(self) -> torch.Tensor:
        """The weight the layer computes with, ``[out, in]`` in the scales' dtype."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.small_kernel is not None and x.dim() == 2 and x.dtype == self.scales.dtype == torch.float32:
            return self.small_kernel(x, self.weight_int8, self.scales)
        if x.device.type == "cpu":
            x2d = x.reshape(-1, self.in_features).to(_KERNEL_DTYPE).contiguous()  # [T, in] bf16
            scales = self.scales_bf16.to(_KERNEL_DTYPE)  # a no-op unless someone cast the module
            out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x2d, self.weight_int8, scales)  # [T, out]
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        # Fallback (CUDA, bf16): the per-row scale commutes with the matmul, so scale the output columns.
        return F.linear(x, self.weight_int8.to(x.dtype)) * self.scales.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scales={self.scales.dtype}"


_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@torch.no_grad()
def quantize_model_int8(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Swap every projection and the LM head for :class:`Int8Linear`, in place; returns ``model``.

    Scales take the dtype of the weight they replace. Norms and the embedding table stay as they are.
    """
    for layer in model.model.layers:
        for path in _PROJECTIONS:
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            old = getattr(parent, attr)
            if isinstance(old, Int8Linear):
                continue
            setattr(parent, attr, Int8Linear.from_weight(old.weight, bias=old.bias))
    if not isinstance(model.lm_head, Int8Linear):
        # Tied embeddings: the head gets its own int8 copy and the embedding table stays in the compute
        # dtype for lookups (a lookup reads a few rows; only the head streams the whole table every step).
        # Cost: vocab * hidden bytes plus vocab scales on top of the table: for SmolLM2-135M 28 MB next to
        # the 113 MB fp32 table, so the model holds ~250 MB instead of 540 MB, and a decode step reads
        # ~135 MB of weights instead of ~540 MB (28 MB of them the head's, instead of 113 MB).
        source = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
        model.lm_head = Int8Linear.from_weight(source)  # type: ignore[assignment]
    return model


# fn(x [M, K] fp32, data, meta) -> [M, N] (cpu.kernels.quant_kernels)
QuantMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
QuantRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class QuantizedLinear(nn.Module):
    """A bias-free linear layer over a GGUF-quantized weight kept as its blocks (:mod:`~tokenmill.model.gguf_blocks`).

    With the C++ kernels (``csrc/quant_linear.h``, every variant) the weight is expanded in registers as it is
    used; without them the forward dequantizes the whole weight in torch each call (correct, slow: the loader
    picks ``fp32`` in that case unless asked otherwise). ``data``/``meta`` are buffers: a tied head and its
    embedding share one copy.
    """

    data: torch.Tensor
    meta: torch.Tensor
    kernel: QuantMatmul | None = None

    def __init__(
        self, weight: QuantizedWeight, kernel: QuantMatmul | None = None, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("data", weight.data)
        self.register_buffer("meta", weight.meta)
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.kernel = kernel
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.data, self.meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
            out = self.kernel(x, self.data, self.meta)
            return out if self.bias is None else out.add_(self.bias)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.dequantize().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.weight.type_summary()}"
        )


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized: a lookup expands only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, rows_kernel: QuantRows | None = None) -> None:
        super().__init__()
        self.register_buffer("data", weight.data)
        self.register_buffer("meta", weight.meta)
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.rows_kernel = rows_kernel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64)
        if self.rows_kernel is not None:
            rows = self.rows_kernel(self.data, self.meta, flat)
        else:
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
                raise IndexError("token id out of range of the embedding table")
            rows = QuantizedWeight(self.data, self.meta).dequantize(flat)
        return rows.view(*ids.shape, self.embedding_dim)


def build_quantized_llama(
    config: LlamaConfig,
    dense: dict[str, torch.Tensor],
    quantized: dict[str, Groups],
    tile_rows: int,
    kernels: tuple[QuantMatmul, QuantRows] | None,
    int8_activations: bool = False,
    wide_quads: bool = True,
    super_block_acts: bool = True,
) -> LlamaForCausalLM:
    """A model whose projections, embedding and head are :class:`QuantizedLinear` / :class:`QuantizedEmbedding`
    where ``quantized`` (Hugging Face names) has them, fp32 from ``dense`` elsewhere (norms, biases, and weights
    of types without a kernel).

    A fused projection takes its parts' formats side by side (q, k, v may differ, as in Q4_K_M files); if one
    part is dense, the whole projection is (its quantized parts dequantized: exact, only larger). A tied head
    shares the embedding's quantized bytes. ``int8_activations``: 4-bit parts in the quad layout and 8-bit parts
    in byte quads (wide ones for Q8_0 and IQ4), multiplied by activations rounded to 8 bits (``gguf_blocks``); the
    table's lookup gives the same fp32 rows either way; ``wide_quads`` False keeps Q8_0 and IQ4 exact;
    ``super_block_acts`` False rounds the K-quants' activations per group of 32, not per super-block of 256.
    """
    matmul, rows = kernels if kernels is not None else (None, None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    quantized = dict(quantized)
    dense = dict(dense)
    consumed: set[str] = set()  # HF names the quantized modules took

    def pack(parts: list[Groups]) -> QuantizedWeight:
        return QuantizedWeight.from_groups(
            parts, tile_rows, int8_activations, wide_quads=wide_quads, super_block_acts=super_block_acts
        )

    def take(parent: nn.Module, attr: str, names: list[str]) -> None:
        if all(n in quantized for n in names):
            biases = [n.removesuffix(".weight") + ".bias" for n in names]
            bias = torch.cat([dense.pop(b) for b in biases]) if all(b in dense for b in biases) else None
            weight = pack([quantized.pop(n) for n in names])
            setattr(parent, attr, QuantizedLinear(weight, matmul, bias))
            consumed.update(names)
            consumed.update(biases if bias is not None else ())
            return
        for n in names:  # mixed: every part dense
            if n in quantized:
                dense[n] = QuantizedWeight.from_groups([quantized.pop(n)], tile_rows).dequantize()

    for i, layer in enumerate(model.model.layers):
        for parent, attr, names in _projection_parts(i, layer, quantized.keys() | dense.keys()):
            take(parent, attr, names)
    embed = quantized.pop("model.embed_tokens.weight", None)
    if embed is not None:
        table = pack([embed])
        model.model.embed_tokens = QuantizedEmbedding(table, rows)  # type: ignore[assignment]
        consumed.add("model.embed_tokens.weight")
        if config.tie_word_embeddings:
            model.lm_head = QuantizedLinear(table, matmul)  # type: ignore[assignment]
    if not config.tie_word_embeddings and "lm_head.weight" in quantized:
        head = pack([quantized.pop("lm_head.weight")])
        model.lm_head = QuantizedLinear(head, matmul)  # type: ignore[assignment]
        consumed.add("lm_head.weight")
    quantized.pop("lm_head.weight", None)  # a tied checkpoint's unused copy
    if quantized:
        raise ValueError(f"unexpected tensors in the checkpoint: {sorted(quantized)[:8]}")
    fused = fuse_hf_state_dict(config, dense, absent=consumed)
    model.load_fused_state_dict({k: v.float() for k, v in fused.items()})
    return model.eval()


def _projection_parts(i: int, layer: nn.Module, present: set[str]) -> list[tuple[nn.Module, str, list[str]]]:
    """Layer ``i``'s projections: (parent module, attribute, the HF names of its parts), q/k/v and gate/up as
    one fused tensor where the checkpoint has it fused (Phi-3), else as parts."""
    p = f"model.layers.{i}"
    fused_qkv, fused_gate_up = f"{p}.self_attn.qkv_proj.weight", f"{p}.mlp.gate_up_proj.weight"
    qkv = [fused_qkv] if fused_qkv in present else [f"{p}.self_attn.{x}_proj.weight" for x in ("q", "k", "v")]
    gate_up = (
        [fused_gate_up] if fused_gate_up in present else [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up")]
    )
    return [
        (layer.self_attn, "qkv_proj", qkv),
        (layer.self_attn, "o_proj", [f"{p}.self_attn.o_proj.weight"]),
        (layer.mlp, "gate_up_proj", gate_up),
        (layer.mlp, "down_proj", [f"{p}.mlp.down_proj.weight"]),
    ]


def quantized_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Every tensor of a model :func:`build_quantized_llama` made, under its module's names (a quantized
    module's ``data`` and ``meta``, fused fp32 tensors as they are): what :func:`rebuild_quantized_llama` takes
    back. A tied head is the table's bytes and is left out."""
    state = model.state_dict()
    head, table = model.lm_head, model.model.embed_tokens
    tied = isinstance(head, QuantizedLinear) and isinstance(table, QuantizedEmbedding)
    if tied and head.data.data_ptr() == table.data.data_ptr():
        for key in ("lm_head.data", "lm_head.meta"):
            state.pop(key)
    return {k: v.contiguous() for k, v in state.items()}


def rebuild_quantized_llama(
    config: LlamaConfig, state: dict[str, torch.Tensor], kernels: tuple[QuantMatmul, QuantRows] | None
) -> LlamaForCausalLM:
    """The model :func:`quantized_state` was taken from, its tensors used as they are (a memory-mapped cache's
    tensors stay mapped: no copy)."""
    matmul, rows = kernels if kernels is not None else (None, None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = dict(state)
    for name in sorted(k.removesuffix(".meta") for k in state if k.endswith(".meta")):
        weight = QuantizedWeight(state.pop(f"{name}.data"), state.pop(f"{name}.meta"))
        if name == "model.embed_tokens":
            model.model.embed_tokens = QuantizedEmbedding(weight, rows)  # type: ignore[assignment]
            if config.tie_word_embeddings:
                model.lm_head = QuantizedLinear(weight, matmul)  # type: ignore[assignment]
            continue
        parent, _, attr = name.rpartition(".")
        setattr(
            model.get_submodule(parent),
            attr,
            QuantizedLinear(weight, matmul, state.pop(f"{name}.bias", None)),
        )
    model.load_fused_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


def weight_breakdown(model: nn.Module) -> dict[str, int]:
    """Where the weights' bytes go, for ``tokenmill info --load``: per kind of tensor (a quantized block
    format, ``fp32``, ``int8``, reordered ``packed`` copies), each storage counted once, as in
    :func:`weight_bytes`; ``mapped`` of them are pages of a memory-mapped file (a cache or the model's own)."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        key, nbytes = _storage(t)
        if key in seen:
            return
        seen.add(key)
        out[kind] = out.get(kind, 0) + nbytes
        if _is_file_mapped(key):
            out["mapped"] = out.get("mapped", 0) + nbytes

    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            role = "embedding" if isinstance(module, QuantizedEmbedding) else "linear"
            add(f"{role} {QuantizedWeight(module.data, module.meta).type_summary()}", module.data)
        for attr in ("packed_weight", "packed_head"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                add("packed", t)
    for t in [*model.parameters(), *model.buffers()]:
        add("int8" if t.dtype == torch.int8 else str(t.dtype).removeprefix("torch."), t)
    return out


def _is_file_mapped(address: int) -> bool:
    """Whether ``address`` lies in a file mapping of this process (Linux's /proc/self/maps); False elsewhere."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, _, rest = line.partition(" ")
                lo, _, hi = span.partition("-")
                if int(lo, 16) <= address < int(hi, 16):
                    fields = rest.split()
                    return len(fields) >= 5 and fields[-1].startswith("/")
    except OSError:
        pass
    return False


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds for its weights (parameters, buffers and reordered copies),
    each storage counted once (a tied head and its table are one)."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for attr in ("packed_weight", "packed_head"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                tensors.append(t)
    for t in tensors:
        if t.device.type == "meta":
            continue
        key, nbytes = _storage(t)
        seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values())


def decode_read_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every storage :func:`weight_bytes` counts except the token
    embedding's table (a step looks up one row of it), unless the head reads the same storage (a tied head); a
    dense layer's reordered copy in place of its weight (the step reads the copy)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding | QuantizedEmbedding)]
    seen: dict[int, int] = {}
    for module in model.modules():
        if module in embeddings:
            continue
        packed = {attr: getattr(module, attr, None) for attr in ("packed_weight", "packed_head")}
        tensors = [t for t in packed.values() if isinstance(t, torch.Tensor)]
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if tensors:  # the copy replaces the weight it was made from
            own = [t for t in own if t is not getattr(module, "weight", None)]
        for t in [*own, *tensors]:
            if t.device.type == "meta":
                continue
            key, nbytes = _storage(t)
            seen[key] = max(seen.get(key, 0), nbytes)  # a tied head: the table's storage, counted by the head
    return sum(seen.values())


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(a key for the tensor's storage, its bytes): a storage shared by two tensors (a tied head) has one key."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except NotImplementedError:  # oneDNN's packed weights: opaque, one owner
        return id(t), t.numel() * t.element_size()
