"""The C++ kernels of the CPU path: built at install, once per instruction set, and loaded here.

``setup.py`` compiles ``csrc/cpu_ops.cpp`` into ``tokenmill._C_avx512``, ``_C_avxvnni``, ``_C_avx2`` and
``_C_base`` (``variants.py`` has their flags; ``csrc/simd.h`` the vector body each selects). :func:`loaded` picks
the best variant this CPU can execute (its flags from /proc/cpuinfo), no better than ``TOKENMILL_CPU_ISA``
(``auto``, ``avx512``, ``avxvnni``, ``avx2``, ``base``) if that is set, and imports only that one: a variant whose
instructions the CPU lacks is never loaded (:func:`load_variant` refuses it). ``TOKENMILL_NO_CPP=1`` loads none.

What the getters below hand out, each the same source in every variant:

- ``paged_decode`` attends one query token per row (a decode row, or a token of a short prefill over its causal
  prefix), reading keys and values in place from the paged cache (``csrc/attention_decode.h``): no gather into a
  padded copy, which is where the pure-torch decode path spends its time at batch 64.
- ``paged_prefill_`` attends the tokens of prefills in tiles per sequence and KV head, as two small
  register-blocked matrix products over K^T and V copied once per sequence and head out of the paged cache
  (``csrc/attention_prefill.h``).
- ``panel_linear`` multiplies by an fp32 weight packed as column panels at every batch size
  (``csrc/panel_linear.h``): the weight read once in storage order for a few decode rows, register-blocked
  outer products for many.
- ``small_linear`` multiplies rows by an int8 weight, reading the weight once in storage order
  (``csrc/small_linear.h``).
- ``quant_linear`` / ``quant_rows`` multiply by, and look rows up in, GGUF-quantized weights kept as their
  blocks (``csrc/quant_linear.h``); on every variant, base included. ``quant_linear_silu`` takes an MLP's
  gate | up and rounds silu(gate) * up to the 8-bit activations as it is made, never storing it in fp32.
- ``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rope_write_kv`` do the eager forward's elementwise work
  in one pass each (``csrc/elementwise.h``) instead of chains of 4-10 torch ops.
- ``DecodeStack`` runs every decoder layer for a step of decode rows in one call (``csrc/decode_stack.h``),
  without the ~2,000 small torch ops per step of the eager forward.

On the portable ``base`` variant the matmuls (and so the decode stack) stay off: its plain vector code, measured on
AVX-512 hardware against oneDNN capped to SSE4.1 (``ONEDNN_MAX_CPU_ISA=SSE41 benchmarks/bench_linear.py --variants
base``), won at 1-16 rows (6.8 vs 11.3 ms, 22.7 vs 33.6) and lost at 256 (58 vs 71 GFLOP/s), and its int8 loop lost
to torch's int8 kernel at every row count (``fast_paths`` says so per path).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import torch

from tokenmill.model.cpu import variants as kv

logger = logging.getLogger(__name__)
# The variants whose matmuls beat torch's (on base they lose: see the module docstring).
_MATMUL_VARIANTS = ("avx512", "avxvnni", "avx2")


@dataclass(frozen=True)
class LoadedKernels:
    """The kernel module in use (None: the torch path everywhere) and why that one."""

    variant: str | None
    module: ModuleType | None
    reason: str
    cpu_model: str
    cpu_flags: frozenset[str]


def load_variant(variant: str, flags: frozenset[str] | None = None) -> ModuleType:
    """Import ``tokenmill._C_<variant>``. RuntimeError where this CPU lacks an instruction set the variant was
    compiled with (it would die of SIGILL on the first kernel), or where the module says it is another variant;
    ImportError where it was not built."""
    if variant not in kv.VARIANTS:
        raise ValueError(f"unknown kernel variant {variant!r}; choose one of {', '.join(kv.VARIANTS)}")
    flags = kv.read_cpu_info()[1] if flags is None else flags
    missing = kv.missing_flags(variant, flags)
    if missing or (variant != "base" and not kv.is_x86()):
        raise RuntimeError(
            f"the {variant} kernels need CPU flags {missing or ['x86-64']}, which this CPU lacks"
        )
    module = importlib.import_module(f"tokenmill._C_{variant}")
    if module.isa() != variant:
        raise RuntimeError(f"tokenmill._C_{variant} was compiled as {module.isa()!r}: rebuild tokenmill")
    return module


@cache
def loaded() -> LoadedKernels:
    """The kernels for this process, chosen and imported once (see the module docstring)."""
    cpu_model, flags = kv.read_cpu_info()
    if os.environ.get("TOKENMILL_NO_CPP") == "1":
        return LoadedKernels(None, None, "TOKENMILL_NO_CPP=1", cpu_model, flags)
    variant = kv.choose_variant(flags, os.environ.get(kv.ENV_CAP))
    best = kv.runnable_variants(flags)[0]
    reason = "the best this CPU runs" if variant == best else f"capped by {kv.ENV_CAP} (the CPU runs {best})"
    try:
        module = load_variant(variant, flags)
    except ImportError as exc:
        logger.warning("C++ kernels not built (%s); using the torch path. Reinstall: make setup", exc)
        return LoadedKernels(None, None, f"tokenmill._C_{variant} is not built: {exc}", cpu_model, flags)
    if kv.CSRC.is_dir() and module.source_digest() != kv.source_digest():
        logger.warning(
            "the C++ kernels were built from other sources than %s: rebuild them (make setup)", kv.CSRC
        )
        reason += "; STALE: built from other sources than csrc/ (make setup)"
    return LoadedKernels(variant, module, reason, cpu_model, flags)


def _module() -> ModuleType | None:
    return loaded().module


def _matmul_module() -> ModuleType | None:
    state = loaded()
    return state.module if state.variant in _MATMUL_VARIANTS else None


_PATHS = (
    "paged_decode",
    "paged_prefill",
    "elementwise",
    "panel_linear",
    "small_linear_int8",
    "quant_linear_gguf",
    "quant_linear_gguf_q8",
    "decode_stack",
)
# the integer dot product of each variant's 8-bit-activation path (simd::qdot)
_Q8_DOT = {
    "avx512": "vpdpbusd",
    "avxvnni": "vpdpbusd (AVX-VNNI)",
    "avx2": "vpmaddubsw + vpmaddwd",
    "base": "plain loops",
}
# The CPU flags `tokenmill info` reports: the ones a variant needs, and a few that say what a CPU could add
_REPORTED_FLAGS = kv.CPU_FLAGS["avx512"] | {"avx512_bf16", "amx_tile", "avx_vnni"}


def fast_paths() -> dict[str, str]:
    """Each fast path: "on", or "off: <reason>" (what ``tokenmill info`` prints)."""
    state = loaded()
    if state.module is None:
        return dict.fromkeys(_PATHS, f"off: no kernels ({state.reason})")
    matmul = (
        "on"
        if state.variant in _MATMUL_VARIANTS
        else "off: the portable build loses to oneDNN / torch's int8"
    )
    return {
        "paged_decode": "on",
        "paged_prefill": f"on (head sizes divisible by {state.module.panel_width()})",
        "elementwise": "on",
        "panel_linear": matmul,
        "small_linear_int8": matmul,
        "quant_linear_gguf": "on",
        "quant_linear_gguf_q8": f"on ({_Q8_DOT.get(state.variant or '', 'integer dot products')})",
        "decode_stack": matmul,
    }


def integer_dot_instruction() -> str:
    """The instruction sequence of the loaded variant's 8-bit-activation dot product (simd::qdot32)."""
    return _Q8_DOT.get(loaded().variant or "", "none")


def kernel_summary() -> dict[str, Any]:
    """The machine and the kernels in use, for ``tokenmill info``, the server's start line and the benchmarks."""
    state = loaded()
    return {
        "cpu_model": state.cpu_model,
        "cpu_isa_flags": sorted(state.cpu_flags & _REPORTED_FLAGS),
        "kernel_variant": state.variant or "none",
        "kernel_reason": state.reason,
        "runnable_variants": kv.runnable_variants(state.cpu_flags),
        "source_digest": state.module.source_digest() if state.module is not None else None,
        "fast_paths": fast_paths(),
    }


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    module = _module()
    return None if module is None else module.paged_decode  # type: ignore[no-any-return]


def paged_prefill_kernel(head_dim: int) -> Callable[..., None] | None:
    """``fn(out, q, k_cache, v_cache, block_tables, seqs [n, 4], scale)`` writing the prefill rows of ``out``
    (``csrc/attention_prefill.h``), or None (no kernels, or a head size not divisible by the panel width)."""
    module = _module()
    if module is None or not module.paged_prefill_supported(head_dim):
        return None
    return module.paged_prefill_  # type: ignore[no-any-return]


def small_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """``fn(x [M, K] fp32, weight [N, K] int8, scale [N] fp32) -> [M, N]``, or None (no kernels, or base)."""
    module = _matmul_module()
    return None if module is None else module.small_linear  # type: ignore[no-any-return]


def quant_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], int] | None:
    """``(matmul, rows, tile_rows)`` for GGUF-quantized weights (``csrc/quant_linear.h``), on every variant (base
    too: the alternative is dequantizing in torch), or None without kernels.

    ``matmul(x [M, K], data, meta) -> [M, N]``; ``rows(data, meta, ids [n]) -> [n, K]``; weights packed for them
    with ``QuantizedWeight.from_groups(..., tile_rows)``.
    """
    module = _module()
    if module is None:
        return None
    return module.quant_linear, module.quant_rows, int(module.quant_tile_rows())


def panel_linear_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], int] | None:
    """``(pack, matmul, panel_width)`` for fp32 linears (``csrc/panel_linear.h``), or None (no kernels, or base).

    ``pack(weight [N, K]) -> panels [ceil(N / W), K, W]`` with ``W = panel_width`` (32 on AVX-512, 16 on AVX2);
    ``matmul(x [M, K], panels, N) -> [M, N]``.
    """
    module = _matmul_module()
    if module is None:
        return None
    return module.pack_panels, module.panel_linear, int(module.panel_width())


def lora_kernel() -> Callable[..., None] | None:
    """``lora_add_(x, out, a, b, slots, part_starts)`` (``csrc/lora.h``: each row's LoRA delta added to ``out`` in
    place), on every variant; None without kernels."""
    module = _module()
    return None if module is None else module.lora_add_  # type: ignore[no-any-return]


def decode_stack_class() -> type | None:
    """The C++ ``DecodeStack`` (``csrc/decode_stack.h``), or None (no kernels, or base: it runs on the matmuls)."""
    module = _matmul_module()
    return None if module is None else module.DecodeStack  # type: ignore[no-any-return]
