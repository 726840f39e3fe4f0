"""The instruction-set variants of the C++ kernels: what each is compiled with and which CPUs may load it.

Pure Python, no torch: ``setup.py`` loads this file by path to build the variants, and
``tokenmill.model.cpu.kernels`` uses it to choose one at run time. ``csrc/simd.h`` holds the vector body of
each variant; this module holds the flags that select it and the CPU flags a machine needs to run it.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

# Best first. A CPU runs a variant when it has every CPU flag (as Linux names them in /proc/cpuinfo) that the
# variant's compiler flags let the compiler use.
VARIANTS = ("avx512", "avxvnni", "avx2", "base")
COMPILE_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
        "-mavx2",
        "-mfma",
        "-mf16c",
    ),
    "avxvnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "base": (),
}
CPU_FLAGS: dict[str, frozenset[str]] = {
    "avx512": frozenset(
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"}
    ),
    "avxvnni": frozenset({"avx2", "fma", "f16c", "avx_vnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "base": frozenset(),
}
# auto (default), avx512, avxvnni, avx2 or base: the best variant tokenmill may load
ENV_CAP = "TOKENMILL_CPU_ISA"
CSRC = Path(__file__).resolve().parent / "csrc"


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def buildable_variants() -> tuple[str, ...]:
    """The variants ``setup.py`` builds on this machine: all four on x86-64, the portable one elsewhere."""
    return VARIANTS if is_x86() else ("base",)


def source_digest(csrc: Path = CSRC) -> str:
    """sha256 prefix over every kernel source (names and bytes); each build carries the one it was built from."""
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.is_file() and path.suffix in (".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def read_cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """(model name, flags) of this CPU from Linux's /proc/cpuinfo; ("unknown", {}) where there is none."""
    model, flags = "unknown", frozenset[str]()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def runnable_variants(flags: frozenset[str]) -> list[str]:
    """The variants a CPU with ``flags`` can execute, best first (``base`` always)."""
    return [v for v in VARIANTS if CPU_FLAGS[v] <= flags and (v == "base" or is_x86())]


def choose_variant(flags: frozenset[str], cap: str | None = None) -> str:
    """The best variant the CPU runs, no better than ``cap`` (``ENV_CAP``'s value; None or "auto": no cap).

    A cap above what the CPU has is not an error: the CPU's best is used (a cap is an upper bound).
    """
    cap = (cap or "auto").strip().lower()
    if cap != "auto" and cap not in VARIANTS:
        raise ValueError(f"{ENV_CAP}={cap!r}: choose one of auto, {', '.join(VARIANTS)}")
    allowed = VARIANTS if cap == "auto" else VARIANTS[VARIANTS.index(cap) :]
    return next(v for v in runnable_variants(flags) if v in allowed)


def missing_flags(variant: str, flags: frozenset[str]) -> list[str]:
    """The CPU flags ``variant`` needs that ``flags`` lacks (empty: the CPU can run it)."""
    return sorted(CPU_FLAGS[variant] - flags)
