"""Optional C++ kernels for the CPU path, compiled on first use with torch's JIT extension builder.

``paged_decode`` reads each decode row's keys and values in place from the paged cache (no gather into a
padded copy), which is where the pure-torch decode path spends its time at batch 64. If the compiler or
ninja is missing, or ``TOKENMILL_NO_CPP=1`` is set, :func:`paged_decode_kernel` returns None and attention
falls back to the torch path; the tests compare both against the reference.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


@cache
def paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    if os.environ.get("TOKENMILL_NO_CPP") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(
            name="tokenmill_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, unsupported platform: fall back to torch
        logger.warning("C++ paged-decode kernel unavailable (%s); using the torch path", exc)
        return None
    return module.paged_decode  # type: ignore[no-any-return]
