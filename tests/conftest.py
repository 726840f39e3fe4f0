"""Test-session settings that must be in place before torch starts its thread pool."""

# tokenmill's OpenMP spin setting (src/tokenmill/__init__.py) must be in place before torch loads: the
# test run starts server subprocesses next to itself, and threads spinning long would crawl.
import importlib.util  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402

import tokenmill  # noqa: F401
from tokenmill.model.cpu import variants as kernel_variants  # noqa: E402  (torch-free)

# Every kernel variant this CPU can execute: an AVX-512 machine tests its AVX2 and portable builds too.
RUNNABLE_VARIANTS = kernel_variants.runnable_variants(kernel_variants.read_cpu_info()[1])


# Set by tests/unit/test_kernels_asan.py in the pytest it starts: a folder of kernel modules built with
# AddressSanitizer, which kernel_variant then hands out instead of the installed ones.
ASAN_DIR_ENV = "TOKENMILL_TEST_ASAN_KERNELS"


def _import_from(folder: Path, name: str) -> ModuleType:
    found = sorted(folder.glob(f"{name}*.so"))
    assert found, f"no {name} module in {folder}"
    spec = importlib.util.spec_from_file_location(name, found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=RUNNABLE_VARIANTS)
def kernel_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One C++ kernel variant, made the process's kernels for the test (what ``cpu_kernels.loaded`` returns).

    A variant this CPU runs that is not built fails the test: a kernel that does not compile is a failure.
    """
    from tokenmill.model.cpu import kernels as cpu_kernels

    state = cpu_kernels.loaded()
    asan_dir = os.environ.get(ASAN_DIR_ENV)
    if asan_dir:  # test_kernels_asan.py's run: the AddressSanitizer builds of the same sources
        module = _import_from(Path(asan_dir), f"_C_{request.param}")
    else:
        module = cpu_kernels.load_variant(request.param, state.cpu_flags)
    fake = cpu_kernels.LoadedKernels(request.param, module, "test", state.cpu_model, state.cpu_flags)
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: fake)
    return module
