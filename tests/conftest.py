"""Test-session settings that must be in place before torch starts its thread pool."""

# tokenmill's OpenMP spin setting (src/tokenmill/__init__.py) must be in place before torch loads: the
# test run starts server subprocesses next to itself, and threads spinning long would crawl.
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402

import tokenmill  # noqa: F401
from tokenmill.model import kernel_variants  # noqa: E402  (torch-free)

# Every kernel variant this CPU can execute: an AVX-512 machine tests its AVX2 and portable builds too.
RUNNABLE_VARIANTS = kernel_variants.runnable_variants(kernel_variants.read_cpu_info()[1])


@pytest.fixture(params=RUNNABLE_VARIANTS)
def kernel_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One C++ kernel variant, made the process's kernels for the test (what ``cpu_kernels.loaded`` returns).

    A variant this CPU runs that is not built fails the test: a kernel that does not compile is a failure.
    """
    from tokenmill.model import cpu_kernels

    state = cpu_kernels.loaded()
    module = cpu_kernels.load_variant(request.param, state.cpu_flags)
    fake = cpu_kernels.LoadedKernels(request.param, module, "test", state.cpu_model, state.cpu_flags)
    monkeypatch.setattr(cpu_kernels, "loaded", lambda: fake)
    return module
