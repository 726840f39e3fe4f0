"""The bandwidth probe's size: larger than the last-level cache Linux reports, so it reads memory, not cache."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
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


def test_the_integer_peak_loop_computes_what_it_claims(kernel_variant) -> None:
    """Each accumulator starts at its index and adds quads whose products cancel (codes in equal pairs, activations
    +1 and -1): the checksum is threads x lanes x (0 + 1 + ... + 11) on every variant, whatever the timing."""
    lanes = {"avx512": 16, "avxvnni": 8, "avx2": 8, "base": 4}[kernel_variant.isa()]
    assert kernel_variant.qdot_peak_ops_per_iter() == 12 * lanes * 4 * 2
    for threads in (1, 2, 3):
        assert kernel_variant.qdot_peak(1000, threads) == threads * lanes * sum(range(12))


def test_the_fp32_peak_loop_computes_what_it_claims(kernel_variant) -> None:
    """Each accumulator starts at its index and multiplies by 1 and adds 0: the checksum is threads x lanes x
    (0 + 1 + ... + 11) on every variant, and one round is 12 multiply-adds of a vector, two flops a lane."""
    lanes = {"avx512": 16, "avxvnni": 8, "avx2": 8, "base": 4}[kernel_variant.isa()]
    assert kernel_variant.fma_peak_flops_per_iter() == 12 * lanes * 2
    for threads in (1, 2, 3):
        assert kernel_variant.fma_peak(1000, threads) == threads * lanes * sum(range(12))


def test_the_dot_and_multiply_add_mix_computes_what_it_claims(kernel_variant) -> None:
    """Where the dot product is one instruction (the VNNI variants) the mixed loop runs D dot-product chains and F
    multiply-add chains, each starting at its index and adding nothing: the checksum is threads x lanes x
    (0 + ... + D-1, then + 0 + ... + F-1 with the multiply-adds); elsewhere it is refused and its counts are 0."""
    lanes = {"avx512": 16, "avxvnni": 8, "avx2": 8, "base": 4}[kernel_variant.isa()]
    counts = {"avx512": [12, 4], "avxvnni": [10, 2], "avx2": [0, 0], "base": [0, 0]}[kernel_variant.isa()]
    assert kernel_variant.dot_fma_mix_counts() == counts
    num_dots, num_fmas = counts
    if num_fmas == 0:
        with pytest.raises(RuntimeError, match="not measured"):
            kernel_variant.dot_fma_mix(10, 1, True)
        return
    for threads in (1, 2):
        assert kernel_variant.dot_fma_mix(1000, threads, False) == threads * lanes * sum(range(num_dots))
        expected = threads * lanes * (sum(range(num_dots)) + sum(range(num_fmas)))
        assert kernel_variant.dot_fma_mix(1000, threads, True) == expected


class _TimedMix:
    """A kernel module whose mixed loop takes `base_s`, and `base_s * ratio` with its multiply-adds."""

    def __init__(self, counts: list[int], base_s: float, ratio: float) -> None:
        self.counts, self.base_s, self.ratio = counts, base_s, ratio

    def dot_fma_mix_counts(self) -> list[int]:
        return self.counts

    def dot_fma_mix(self, iters: int, threads: int, with_fmas: bool) -> int:
        time.sleep(self.base_s * (self.ratio if with_fmas else 1.0))
        return 0


@pytest.mark.parametrize(
    ("ratio", "share"), [(1.0 + 4 / 12, 1.0), (1.0 + 2 / 12, 0.5), (1.0, 0.0), (0.9, 0.0), (2.0, 1.0)]
)
def test_a_multiply_adds_share_of_a_dot_products_slot(monkeypatch, ratio: float, share: float) -> None:
    """(time with / time without - 1) x D / F, clipped to [0, 1]: 4 multiply-adds beside 12 dot products that cost
    4/12 more take whole slots; half that, half a slot; none of it (or a faster loop), none."""
    from tokenmill.model import hardware
    from tokenmill.model.cpu import kernels

    fake = _TimedMix([12, 4], 0.02, ratio)
    monkeypatch.setattr(kernels, "loaded", lambda: SimpleNamespace(module=fake))
    assert hardware.measure_fma_dot_share(min_total_s=0.05) == pytest.approx(share, abs=0.12)
    monkeypatch.setattr(kernels, "loaded", lambda: SimpleNamespace(module=_TimedMix([0, 0], 0.0, 1.0)))
    assert hardware.measure_fma_dot_share(min_total_s=0.05) is None  # AVX2, base


def test_the_fp32_limit_is_the_register_peak_and_never_below_a_matmul() -> None:
    from tokenmill.model.hardware import measure

    limits = measure("cpu", torch.float32, [("small", 64, 64)], token_counts=(64,), bandwidth_bytes=1 << 20,
                     quick=True)  # fmt: skip
    assert limits.peak_fma_flops is not None and limits.peak_fma_flops > 0
    assert limits.peak_flops == max(limits.peak_fma_flops, limits.peak_matmul_flops)
    assert limits.peak_matmul_flops == max(p.gflops for p in limits.matmul) * 1e9
    assert "fp32 multiply-add in registers" in limits.describe()


def test_machine_limits_are_measured_once_and_read_after(tmp_path: Path, monkeypatch) -> None:
    from tokenmill.model import hardware_cache
    from tokenmill.model.hardware import HardwareLimits, MatmulPoint

    calls = []

    def fake_measure(*args, **kwargs) -> HardwareLimits:
        calls.append(args)
        return HardwareLimits("cpu", "float32", 2, 100e9, 20e9, [MatmulPoint("up", 1024, 1536, 8960, 100.0)],
                              {"sum": 20e9}, 1 << 28, None, 400e9, "vpdpbusd")  # fmt: skip

    monkeypatch.setattr(hardware_cache, "measure", fake_measure)
    first, source = hardware_cache.machine_limits(tmp_path)
    assert len(calls) == 1 and source.startswith("measured in") and "cached in" in source
    again, source = hardware_cache.machine_limits(tmp_path)
    assert len(calls) == 1 and source.startswith("cached in") and again == first
    hardware_cache.machine_limits(tmp_path, refresh=True)
    assert len(calls) == 2
    (path,) = (tmp_path / "hardware").glob("limits-*.json")
    path.write_text("{not json")  # damaged: measured again, never fatal
    hardware_cache.machine_limits(tmp_path)
    assert len(calls) == 3
    key = hardware_cache.machine_key()
    assert (
        hardware_cache.read(path, {**key, "num_threads": key["num_threads"] + 1}) is None
    )  # another machine
    assert hardware_cache.read(path, key) is not None
    # kernels built from other sources (the integer probe among them): measured again
    assert "kernel_sources" in key and hardware_cache.read(path, {**key, "kernel_sources": "0" * 16}) is None
