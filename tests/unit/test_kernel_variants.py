"""Which kernel variant a CPU gets, and that a variant built for instructions the CPU lacks is never loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.model.cpu import variants as kv

# /proc/cpuinfo flags of the two kinds of machine the project meets (trimmed to the vector ones that matter)
ZEN3 = frozenset(
    ["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"]
)
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512dq", "avx512bw", "avx512vl"}  # AVX-512 without VNNI
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX-VNNI without AVX-512
ZEN5 = SAPPHIRE_RAPIDS | {"avx_vnni"}


@pytest.mark.parametrize(
    ("flags", "cap", "expected"),
    [
        (SAPPHIRE_RAPIDS, None, "avx512"),
        (SAPPHIRE_RAPIDS, "auto", "avx512"),
        (SAPPHIRE_RAPIDS, "avx2", "avx2"),
        (SAPPHIRE_RAPIDS, "base", "base"),
        (ZEN3, None, "avx2"),
        (ZEN3, "avx512", "avx2"),  # a cap is an upper bound, not a demand
        (SKYLAKE_X, None, "avx2"),  # the avx512 variant uses VNNI
        (ALDER_LAKE, None, "avxvnni"),
        (ALDER_LAKE, "avx512", "avxvnni"),
        (ALDER_LAKE, "avx2", "avx2"),
        (ZEN5, None, "avx512"),
        (ZEN5, "avxvnni", "avxvnni"),
        (SKYLAKE_X, "avxvnni", "avx2"),
        (frozenset({"sse2", "avx", "fma"}), None, "base"),  # AVX without AVX2
        (frozenset(), "AVX2", "base"),
    ],
)
def test_choose_variant(flags: frozenset[str], cap: str | None, expected: str) -> None:
    if not kv.is_x86() and expected != "base":
        pytest.skip("x86 variants are chosen only on x86-64")
    assert kv.choose_variant(flags, cap) == expected


def test_a_bad_cap_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA='sse9'.*avx512, avxvnni, avx2, base"):
        kv.choose_variant(ZEN3, "sse9")


def test_read_cpu_info_parses_linux_cpuinfo(tmp_path: Path) -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma f16c\n\nprocessor\t: 1\n"
    (tmp_path / "cpuinfo").write_text(text + "model name\t: other\nflags\t\t: fpu\n")
    assert kv.read_cpu_info(tmp_path / "cpuinfo") == (
        "AMD EPYC 7B13",
        frozenset({"fpu", "avx2", "fma", "f16c"}),
    )
    assert kv.read_cpu_info(tmp_path / "missing")[1] == frozenset()


def test_load_variant_refuses_instructions_the_cpu_lacks() -> None:
    from tokenmill.model.cpu.kernels import load_variant

    with pytest.raises(RuntimeError, match=r"avx512 kernels need CPU flags \['avx512_vnni'"):
        load_variant("avx512", SKYLAKE_X)
    with pytest.raises(RuntimeError, match="avx2 kernels need"):
        load_variant("avx2", frozenset({"avx"}))
    with pytest.raises(RuntimeError, match=r"avxvnni kernels need CPU flags \['avx_vnni'\]"):
        load_variant("avxvnni", ZEN3)
    with pytest.raises(ValueError, match="unknown kernel variant"):
        load_variant("neon")


def _loaded_in_subprocess(flags: frozenset[str], env: dict[str, str] | None = None) -> dict[str, object]:
    """Which variant a fresh process loads when its CPU reports ``flags``, and every kernel module imported."""
    code = f"""
import json, sys
from tokenmill.model.cpu import variants as kv
kv.read_cpu_info = lambda *a: ("test CPU", frozenset({sorted(flags)!r}))
from tokenmill.model.cpu import kernels as cpu_kernels
state = cpu_kernels.loaded()
print(json.dumps({{"variant": state.variant, "modules": sorted(m for m in sys.modules if m.startswith("tokenmill._C_")),
                  "paths": cpu_kernels.fast_paths()}}))
"""
    run_env = {k: v for k, v in os.environ.items() if k not in (kv.ENV_CAP, "TOKENMILL_NO_CPP")}
    run_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=run_env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not kv.is_x86(), reason="x86 variants exist only on x86-64")
def test_an_avx2_cpu_never_imports_the_avx512_build() -> None:
    got = _loaded_in_subprocess(ZEN3)
    assert got["variant"] == "avx2" and got["modules"] == ["tokenmill._C_avx2"]
    paths = got["paths"]
    assert set(paths.values()) <= {  # type: ignore[union-attr]
        "on",
        "on (head sizes divisible by 16)",
        "on (vpmaddubsw + vpmaddwd)",  # gguf-q8's integer dot products without VNNI
    }
    assert paths["quant_linear_gguf_q8"] == "on (vpmaddubsw + vpmaddwd)"  # type: ignore[index]


@pytest.mark.skipif(
    "avx_vnni" not in kv.read_cpu_info()[1], reason="the AVX-VNNI build runs only where the CPU has AVX-VNNI"
)
def test_an_avx_vnni_cpu_without_avx512_gets_vpdpbusd_on_256_bits() -> None:
    got = _loaded_in_subprocess(ALDER_LAKE)
    assert got["variant"] == "avxvnni" and got["modules"] == ["tokenmill._C_avxvnni"]
    assert got["paths"]["quant_linear_gguf_q8"] == "on (vpdpbusd (AVX-VNNI))"  # type: ignore[index]
    assert got["paths"]["panel_linear"] == "on"  # type: ignore[index]


def test_the_cap_and_the_off_switch() -> None:
    got = _loaded_in_subprocess(SAPPHIRE_RAPIDS, {kv.ENV_CAP: "base"})
    assert got["variant"] == "base" and got["modules"] == ["tokenmill._C_base"]
    paths = got["paths"]
    assert (
        isinstance(paths, dict) and paths["paged_decode"] == "on" and paths["panel_linear"].startswith("off")
    )
    got = _loaded_in_subprocess(SAPPHIRE_RAPIDS, {"TOKENMILL_NO_CPP": "1"})
    assert got["variant"] is None and got["modules"] == []


@pytest.mark.parametrize("variant", kv.buildable_variants())
def test_every_variant_is_built_from_these_sources(variant: str) -> None:
    """Installed (or built in place by make setup) from the kernel sources in this tree, not a stale build.

    A variant this CPU cannot run is never imported: its module's initialisation may already hold instructions
    the CPU lacks (importing the AVX-512 build on an AVX2-only Zen 3 dies of SIGILL). Its file must then hold the
    digest string the build compiled in."""
    import importlib
    import importlib.util

    _, flags = kv.read_cpu_info()
    if variant in kv.runnable_variants(flags):
        module = importlib.import_module(f"tokenmill._C_{variant}")
        assert module.isa() == variant
        assert module.source_digest() == kv.source_digest()
        return
    spec = importlib.util.find_spec(f"tokenmill._C_{variant}")  # finds the file, runs nothing
    assert spec is not None and spec.origin is not None
    with open(spec.origin, "rb") as built:
        assert kv.source_digest().encode() in built.read()


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.skipif(not kv.is_x86(), reason="x86 variants exist only on x86-64")
@pytest.mark.parametrize(
    ("variant", "forbidden"),
    [("avxvnni", ("%zmm",)), ("avx2", ("%zmm",)), ("base", ("%ymm", "%zmm"))],
)
def test_a_variant_holds_no_wider_instructions_than_its_own(variant: str, forbidden: tuple[str, ...]) -> None:
    """The AVX2 and AVX-VNNI builds have no AVX-512 register and no EVEX-encoded instruction (first byte 0x62 in
    64-bit code: AVX-512's encoding, which faults on a CPU without it even on 256-bit registers), the portable
    build no AVX register: they run where they claim."""
    import importlib.util

    spec = importlib.util.find_spec(f"tokenmill._C_{variant}")  # the file only: nothing of it runs here
    assert spec is not None and spec.origin is not None
    path = spec.origin
    # every instruction's bytes on its own line (x86 instructions are at most 15 bytes)
    listing = subprocess.run(
        ["objdump", "-d", "--insn-width=15", path], capture_output=True, text=True, check=True
    ).stdout
    assert listing.count("\tv") > 0 or variant == "base"  # the AVX2 build does use vector instructions
    assert not [register for register in forbidden if register in listing]
    # "  addr:\t62 f2 7d 28 50 c1 \tvpdpbusd ...": the instruction's raw bytes are the second field
    fields = [line.split("\t") for line in listing.splitlines()]
    evex = ["\t".join(f) for f in fields if len(f) >= 3 and f[1].startswith("62 ") and f[2].strip()]
    assert not evex, evex[:3]
    if variant == "avxvnni":
        dots = [line for line in listing.splitlines() if "vpdpbusd" in line]
        assert dots and all("{vex}" in line for line in dots)  # AVX-VNNI's encoding, every one
