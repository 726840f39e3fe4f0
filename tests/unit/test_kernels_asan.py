"""The kernel tests once more, on kernel modules built with AddressSanitizer (slow: it compiles each variant).

A kernel that reads past what it wrote may pass a numeric test by luck (the bytes there happen to be mapped);
under ASan the read is an error with a stack. Each variant this CPU runs is compiled from the same
``csrc/cpu_ops.cpp`` with ``-fsanitize=address`` into a temporary folder, then a pytest of the kernel tests runs
in a subprocess with the ASan runtime preloaded (Python itself is not instrumented) and ``kernel_variant``
pointed at those modules (``tests/conftest.py``). The run must pass and ASan must report nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.model.cpu import variants as kv

ASAN_DIR_ENV = "TOKENMILL_TEST_ASAN_KERNELS"  # read by tests/conftest.py's kernel_variant
RUNNABLE_VARIANTS = kv.runnable_variants(kv.read_cpu_info()[1])

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = [
    "tests/unit/test_quant_kernel_rows.py",
    "tests/unit/test_gguf_blocks.py",
    "tests/unit/test_cpu_kernels.py",
    "tests/unit/test_attention.py",
    "tests/unit/test_lora_kernel.py",
    "tests/unit/test_hardware_probe.py",
    "tests/unit/test_thread_counts.py",
]


# Compiled and imported in a process that has the ASan runtime preloaded: an instrumented module imported
# anywhere else aborts ("ASan runtime does not come first").
BUILD = """
import sys
from torch.utils.cpp_extension import load
from tokenmill.model.cpu import variants as kv
variant, folder = sys.argv[1], sys.argv[2]
load(
    name="_C_" + variant,
    sources=[str(kv.CSRC / "cpu_ops.cpp")],
    extra_include_paths=[str(kv.CSRC)],
    extra_cflags=["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address", "-fopenmp", "-std=c++17",
                  *kv.COMPILE_FLAGS[variant]],
    extra_ldflags=["-fsanitize=address", "-fopenmp"],
    build_directory=folder,
)
"""


def _gcc_library(name: str) -> str:
    out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), f"g++ does not know {name}: {path!r}"
    return os.path.realpath(path)


def _preload() -> str:
    """The ASan runtime first, then libstdc++: Python does not link it, and without it loaded at start ASan's
    ``__cxa_throw`` interceptor finds no real one and aborts on the first C++ exception (a TORCH_CHECK)."""
    return f"{_gcc_library('libasan.so')}:{_gcc_library('libstdc++.so')}"


@pytest.mark.slow
def test_kernel_tests_pass_under_address_sanitizer(tmp_path: Path) -> None:
    env = {
        **os.environ,
        ASAN_DIR_ENV: str(tmp_path),
        "LD_PRELOAD": _preload(),
        # Python and torch leak by design at exit; a read or write out of bounds still aborts the run
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
    }
    for variant in RUNNABLE_VARIANTS:
        folder = tmp_path / variant
        folder.mkdir()
        built = subprocess.run(
            [sys.executable, "-c", BUILD, variant, str(folder)], env=env, capture_output=True, text=True
        )
        # a compile error fails the test: never a skip
        assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
        (tmp_path / f"_C_{variant}.so").symlink_to(folder / f"_C_{variant}.so")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            *KERNEL_TESTS,
            "-k",
            "not asan",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = done.stdout + done.stderr
    assert "AddressSanitizer" not in output, output[-6000:]
    assert done.returncode == 0, output[-6000:]
    assert " passed" in output and " failed" not in output, output[-3000:]
