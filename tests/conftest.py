"""Test-session settings that must be in place before torch starts its thread pool."""

# tokenmill's OpenMP spin setting (src/tokenmill/__init__.py) must be in place before torch loads: the
# test run starts server subprocesses next to itself, and threads spinning long would crawl.
import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

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


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Each test ends with torch's thread count as it found it: an engine's thread governor sets the process-wide
    count (one thread where it measured one faster), which would otherwise carry into every later test."""
    import torch

    num_threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


class HFFromGGUF:
    """transformers' own reading of GGUF files, the independent reference, with each file parsed once a session.

    transformers parses a file's metadata with the gguf package on every ``from_pretrained`` (twice for a model:
    config, then tensors) and rebuilds the gguf package's tensor-name map for every module it names: seconds each
    on these CPUs. A parsed ``GGUFReader`` is read-only and the name map a pure function of its arguments, so while
    transformers reads, both are served from a cache; what transformers computes from them is unchanged.
    """

    def __init__(self) -> None:
        self._readers: dict[tuple[str, int, int, str], object] = {}
        self._name_map: Any = None  # the gguf package's get_tensor_name_map, memoized

    @contextlib.contextmanager
    def shared_parsing(self) -> Iterator[None]:
        import gguf

        real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

        def reader(path: str | os.PathLike[str], mode: str = "r") -> object:
            stat = os.stat(path)  # a file rewritten in place is parsed again
            key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size, mode)
            if key not in self._readers:
                self._readers[key] = real_reader(path, mode)
            return self._readers[key]

        gguf.GGUFReader = reader  # type: ignore[assignment,misc]
        if self._name_map is None:  # one cache a session: the map depends on the architecture and depth alone
            self._name_map = functools.lru_cache(maxsize=None)(real_name_map)
        gguf.get_tensor_name_map = self._name_map  # type: ignore[assignment]
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map  # type: ignore[misc]

    def tokenizer(self, path: Path) -> Any:
        """A fresh ``AutoTokenizer`` of ``path`` (a caller may add tokens to it)."""
        from transformers import AutoTokenizer

        with self.shared_parsing():
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def model(self, path: Path) -> Any:
        """``AutoModelForCausalLM`` of ``path`` in float32, in eval mode."""
        import torch
        from transformers import AutoModelForCausalLM

        with self.shared_parsing():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
        return model.eval()


@pytest.fixture(scope="session")
def hf_gguf() -> HFFromGGUF:
    """transformers' readings of GGUF files (``hf_gguf.tokenizer(path)``, ``hf_gguf.model(path)``)."""
    pytest.importorskip("transformers")
    return HFFromGGUF()


@pytest.fixture(scope="session")
def embedded_tokenizer() -> Any:
    """tokenmill's ``Tokenizer`` of the embedded model, read once a session (it is never modified)."""
    from tokenmill.model.embedded import embedded_model_path
    from tokenmill.tokenizer import Tokenizer

    return Tokenizer.from_gguf(embedded_model_path())
