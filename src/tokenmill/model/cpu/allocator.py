"""glibc's malloc told to keep a step's freed activations for the next step instead of giving them back.

By default glibc serves an allocation above its mmap threshold (128 KiB at first, raised to the largest block freed
so far, at most 32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` when it is freed, and trims the heap's
free top above its trim threshold. A prefill's activations are tens of MB (the 1.5B's gate/up output for 512
tokens: 512 x 17,920 x 4 bytes, 37 MB), so every step mapped them anew and the kernel zeroed every page on its
first touch: 4% of a mixed-request run's samples in ``clear_page_erms`` alone, and about 1.6x the page faults
(Qwen2.5-Coder-1.5B, 16 mixed requests, ``benchmarks.served_mix``: 415-434 thousand faults against 262-264
thousand, 38.0-41.9 s against 35.9-36.4 s; AMD EPYC family 25 model 17, 2026-12-05). With both thresholds at
1 GiB the heap keeps the freed blocks and the next step reuses them: the process holds its largest step's
activations between steps (what it needs again at the next prefill), as vLLM's CPU backend does by asking for
tcmalloc.

A thread other than the main one (the server's engine thread) takes its blocks from an arena of its own, whose
heaps are unmapped when they empty: there only blocks up to about 30 MiB stay between steps (glibc 2.36, measured:
30 MiB blocks reused from the third on, 32 MiB and larger faulted in anew every time), whatever the thresholds.

:func:`keep_step_memory` is called by the model runner once its KV cache is allocated: the first engine's cache stays
mapped (its end gives it back); an engine made later in the same process takes its cache from the heap.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform

logger = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_step_memory() -> bool:
    """Set glibc's mmap and trim thresholds to :data:`THRESHOLD_BYTES` (once per process); False where the C
    library is not glibc (musl, macOS: left as they are)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES)
    )
    if not ok:
        logger.debug("glibc refused the malloc thresholds; each step maps its activations anew")
    return ok
