"""The bandwidth probe's size: larger than the last-level cache Linux reports, so it reads memory, not cache."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.model.hardware import bandwidth_probe_bytes, last_level_cache_bytes


def _cache(root: Path, index: int, kind: str, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir(parents=True)
    (d / "type").write_text(kind + "\n")
    (d / "size").write_text(size + "\n")


def test_last_level_cache_is_the_largest_data_or_unified_cache(tmp_path: Path) -> None:
    _cache(tmp_path, 0, "Data", "48K")
    _cache(tmp_path, 1, "Instruction", "64M")  # an instruction cache never counts, however large
    _cache(tmp_path, 2, "Unified", "2048K")
    _cache(tmp_path, 3, "Unified", "491520K")
    assert last_level_cache_bytes(tmp_path) == 480 << 20


def test_no_cache_reported(tmp_path: Path) -> None:
    assert last_level_cache_bytes(tmp_path) is None


def test_probe_is_twice_the_cache_within_bounds() -> None:
    cpu = torch.device("cpu")
    assert bandwidth_probe_bytes(cpu, 480 << 20) == 960 << 20  # the KVM Xeon that reports 480 MiB of L3
    assert bandwidth_probe_bytes(cpu, 32 << 20) == 256 << 20  # Zen 3: the 256 MiB floor
    assert bandwidth_probe_bytes(cpu, None) == 256 << 20
    assert bandwidth_probe_bytes(cpu, 8 << 30) == 4 << 30  # capped
    assert bandwidth_probe_bytes(torch.device("cuda"), 480 << 20) == 2 << 30
