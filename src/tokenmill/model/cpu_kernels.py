"""Optional C++ kernels for the CPU path, compiled on first use with torch's JIT extension builder.

- ``paged_decode`` attends one query token per row (a decode row, or a token of a short prefill over its causal
  prefix), reading keys and values in place from the paged cache (``csrc/attention_decode.h``): no gather into a
  padded copy, which is where the pure-torch decode path spends its time at batch 64.
- ``paged_prefill_`` attends the tokens of short prefills in tiles per sequence and KV head, as two small
  register-blocked matrix products over the paged cache (``csrc/attention_prefill.h``).
- ``panel_linear`` multiplies by an fp32 weight packed as column panels at every batch size
  (``csrc/panel_linear.h``): the weight read once in storage order for a few decode rows, register-blocked
  outer products for many.
- ``small_linear`` multiplies rows by an int8 weight, reading the weight once in storage order
  (``csrc/small_linear.h``).
- ``rms_norm``, ``add_rms_norm_``, ``silu_mul``, ``rope_write_kv`` do the eager forward's elementwise work
  in one pass each (``csrc/elementwise.h``) instead of chains of 4-10 torch ops.
- ``DecodeStack`` runs every decoder layer for a step of a few decode rows in one call
  (``csrc/decode_stack.h``), without the ~2,000 small torch ops per step of the eager forward.

All of them live in one module built from ``csrc/cpu_ops.cpp`` (~40 s, once; cached in
``~/.cache/torch_extensions``).

If the compiler or ninja is missing, or ``TOKENMILL_NO_CPP=1`` is set, the getters return None and the model
falls back to torch; the tests compare both against the reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"


@cache
def _module() -> ModuleType | None:
    if os.environ.get("TOKENMILL_NO_CPP") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # The name carries a digest of every source, headers included: an edited header means a new build.
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(_CSRC.iterdir()))).hexdigest()[:12]
        return load(
            name=f"tokenmill_cpu_ops_{digest}",
            sources=[str(_CSRC / "cpu_ops.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(_CSRC)],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported platform: fall back to torch
        logger.warning("C++ kernels unavailable (%s); using the torch path", exc)
        return None


def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    module = _module()
    return None if module is None else module.paged_decode  # type: ignore[no-any-return]


def paged_prefill_kernel(head_dim: int) -> Callable[..., None] | None:
    """``fn(out, q, k_cache, v_cache, block_tables, seqs [n, 4], scale)`` writing the prefill rows of ``out``
    (``csrc/attention_prefill.h``), or None (no kernels, no AVX-512, or a head size it does not take)."""
    module = _module()
    if module is None or not module.paged_prefill_supported(head_dim):
        return None
    return module.paged_prefill_  # type: ignore[no-any-return]


def small_linear_kernel() -> Callable[..., torch.Tensor] | None:
    """``fn(x [M, K] fp32, weight [N, K] int8, scale [N] fp32) -> [M, N]``, or None.

    None also where the build lacks AVX-512: the portable loop it would fall back to is slower than torch's.
    """
    module = _module()
    if module is None or not module.has_avx512():
        return None
    return module.small_linear  # type: ignore[no-any-return]


def panel_linear_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] | None:
    """``(pack, matmul)`` for fp32 linears (``csrc/panel_linear.h``), or None (no kernels, or no AVX-512).

    ``pack(weight [N, K]) -> panels [ceil(N / 32), K, 32]``; ``matmul(x [M, K], panels, N) -> [M, N]``.
    """
    module = _module()
    if module is None or not module.panel_linear_available():
        return None
    return module.pack_panels, module.panel_linear


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The module with ``rms_norm``, ``add_rms_norm_``, ``silu_mul`` and ``rope_write_kv`` (``csrc/elementwise.h``)
    when ``x`` is a contiguous fp32 CPU matrix they take, else None (the caller's torch path)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous():
        return None
    return _module()


def decode_stack_class() -> type | None:
    """The C++ ``DecodeStack`` (``csrc/decode_stack.h``), or None; AVX-512 builds only, like small_linear."""
    module = _module()
    if module is None or not module.has_avx512():
        return None
    return module.DecodeStack  # type: ignore[no-any-return]
