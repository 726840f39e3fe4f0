"""The machine's limits measured once per machine and kept in the cache directory.

``model/hardware.py`` measures the fp32 multiply-add peak, the integer dot-product peak and the read bandwidth in a
few seconds; a server's roofline (``--hardware-limits``, ``tokenmill.measure.roofline``) needs them at every start. This
module keeps one JSON file per machine as the engine sees it: the CPU's model name, its flags, its core count,
the torch thread count and the kernel variant (any of them changed: another file, measured again). The first
start measures and says so; later starts read the file.

    <cache>/hardware/limits-<key digest>.json   {"key": {...}, "limits": HardwareLimits.as_dict()}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill.model.hardware import HardwareLimits, MatmulPoint, measure

logger = logging.getLogger("tokenmill.hardware")

# fp32 shapes large enough to show torch's matmul peak whatever model runs (a 1.5B's projections)
MACHINE_SHAPES = [("hidden", 1536, 1536), ("up", 1536, 8960), ("down", 8960, 1536)]
CACHE_VERSION = 2  # 2: peak_flops is the register-resident multiply-add's rate


def machine_key(num_threads: int | None = None) -> dict[str, Any]:
    """What the limits depend on: the CPU (model name, flags, cores), the threads and the kernels loaded (their
    variant and the sources they were built from: the integer probe is one of them)."""
    from tokenmill.model.cpu.kernels import loaded

    state = loaded()
    return {
        "cpu_model": state.cpu_model,
        "cpu_flags": sorted(state.cpu_flags),
        "num_cores": os.cpu_count(),
        "num_threads": num_threads or torch.get_num_threads(),
        "kernel_variant": state.variant,
        "kernel_sources": state.module.source_digest() if state.module is not None else None,
        "version": CACHE_VERSION,
    }


def cache_path(key: dict[str, Any], cache_dir: Path | None = None) -> Path:
    from tokenmill.model.registry import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache_dir or cache_root()) / "hardware" / f"limits-{digest}.json"


def _from_dict(data: dict[str, Any]) -> HardwareLimits:
    data = dict(data)
    data["matmul"] = [MatmulPoint(**p) for p in data.get("matmul", [])]
    return HardwareLimits(**data)


def read(path: Path, key: dict[str, Any]) -> HardwareLimits | None:
    """The cached limits, or None when absent, unreadable or of another key (then they are measured again)."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        return _from_dict(data["limits"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def machine_limits(cache_dir: Path | None = None, refresh: bool = False) -> tuple[HardwareLimits, str]:
    """This machine's limits on CPU and where they came from: the cache file, or measured now (and cached)."""
    key = machine_key()
    path = cache_path(key, cache_dir)
    cached = None if refresh else read(path, key)
    if cached is not None:
        return cached, f"cached in {path}"
    t0 = time.perf_counter()
    limits = measure("cpu", torch.float32, MACHINE_SHAPES, token_counts=(1024,), quick=True)
    elapsed_s = time.perf_counter() - t0
    source = f"measured in {elapsed_s:.1f} s"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "limits": limits.as_dict()}, indent=1))
        tmp.replace(path)
        source += f", cached in {path}"
    except OSError as exc:  # an unwritable cache costs a measurement next start, not this one
        logger.warning("could not cache the hardware limits at %s: %s", path, exc)
    return limits, source
