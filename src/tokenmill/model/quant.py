"""Weight-only int8: every projection and the LM head hold int8 weights and one scale per output channel.

Decode at batch 1 streams every weight once per token, so it is bound by memory bandwidth; int8 weights
are a quarter of the fp32 bytes. Quantization is symmetric per output row: ``scale = max|w_row| / 127``,
``q = round(w / scale)`` in [-127, 127], so ``|w - q * scale| <= scale / 2`` per element.

Forward on CPU, once :func:`tokenmill.model.cpu_packing.attach_cpu_kernels` has run (the loader does it): the
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

from tokenmill.model.llama import LlamaForCausalLM

# fn(x [M, K] float32, weight [N, K] int8, scale [N] float32) -> [M, N] (cpu_kernels.small_linear_kernel)
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
    # Set by cpu_packing.attach_cpu_kernels: every fp32 batch then goes to the C++ kernel.
    small_kernel: SmallLinearKernel | None = None

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor) -> None:
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

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Int8Linear:
        """Quantize ``weight [out, in]``; scales in ``dtype`` (default: the weight's dtype), on the bf16 grid."""
        q, scales = quantize_per_channel(weight, _KERNEL_DTYPE)
        return cls(q, scales.to(dtype or weight.dtype))

    def dequantize(self) -> torch.Tensor:
        """The weight the layer computes with, ``[out, in]`` in the scales' dtype."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
            setattr(parent, attr, Int8Linear.from_weight(old.weight))
    if not isinstance(model.lm_head, Int8Linear):
        # Tied embeddings: the head gets its own int8 copy and the embedding table stays in the compute
        # dtype for lookups (a lookup reads a few rows; only the head streams the whole table every step).
        # Cost: vocab * hidden bytes plus vocab scales on top of the table: for SmolLM2-135M 28 MB next to
        # the 113 MB fp32 table, so the model holds ~250 MB instead of 540 MB, and a decode step reads
        # ~135 MB of weights instead of ~540 MB (28 MB of them the head's, instead of 113 MB).
        source = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight
        model.lm_head = Int8Linear.from_weight(source)  # type: ignore[assignment]
    return model
