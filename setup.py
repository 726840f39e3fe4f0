"""Builds tokenmill's C++ CPU kernels at install, once per instruction-set variant (metadata: pyproject.toml).

``src/tokenmill/model/cpu/csrc/cpu_ops.cpp`` is compiled four times, into ``tokenmill._C_avx512``, ``_C_avxvnni``,
``_C_avx2`` and ``_C_base``, each with its own flags (``csrc/simd.h`` picks the vector body from them); at import,
``tokenmill.model.cpu.kernels`` loads the best variant the CPU can run. No compiler is needed after install. A
variant that fails to compile fails the build. On a CPU that is not x86-64 only the portable ``base`` variant is
built. ``TOKENMILL_VARIANTS=avx2,base`` (say) builds a subset, for a quicker development build.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
# The variants, their flags and the source digest have one definition, shared with the run-time loader; loaded
# by path, since the package itself is not importable before it is built.
_spec = importlib.util.spec_from_file_location(
    "kernel_variants", ROOT / "src/tokenmill/model/cpu/variants.py"
)
assert _spec is not None and _spec.loader is not None
kv = importlib.util.module_from_spec(_spec)
sys.modules["kernel_variants"] = kv
_spec.loader.exec_module(kv)


def variants() -> list[str]:
    chosen = list(kv.buildable_variants())
    wanted = os.environ.get("TOKENMILL_VARIANTS")
    if wanted:
        names = [name.strip() for name in wanted.split(",") if name.strip()]
        unknown = [name for name in names if name not in chosen]
        if unknown:
            raise ValueError(f"TOKENMILL_VARIANTS names {unknown}; this machine builds {chosen}")
        chosen = names
    return chosen


class BuildVariants(BuildExtension):
    """torch's BuildExtension with a build folder per extension: the variants compile the same source file, and
    one object path for all of them would let one variant's object (with its instruction set) into another."""

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        shared_temp = self.build_temp
        self.build_temp = os.path.join(shared_temp, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared_temp


def extensions() -> list[CppExtension]:
    digest = kv.source_digest()
    source = str((kv.CSRC / "cpu_ops.cpp").relative_to(ROOT))
    # Hidden visibility: the variants define the same C++ names, and none may bind to another's.
    common = ["-O3", "-g0", "-fopenmp", "-std=c++17", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
    common.append(f'-DTOKENMILL_SOURCE_DIGEST="{digest}"')
    return [
        CppExtension(
            name=f"tokenmill._C_{name}",
            sources=[source],
            include_dirs=[str(kv.CSRC)],
            extra_compile_args=[*common, *kv.COMPILE_FLAGS[name]],
            extra_link_args=["-fopenmp"],
        )
        for name in variants()
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildVariants})
