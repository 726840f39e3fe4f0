"""The scheduler side of the engine imports without torch (the line the import graph must hold)."""

from __future__ import annotations

import subprocess
import sys

PURE_MODULES = [
    "tokenmill.cache",
    "tokenmill.cache.block_pool",
    "tokenmill.cache.kv_cache_manager",
    "tokenmill.core",
    "tokenmill.core.sched_output",
    "tokenmill.core.scheduler",
    "tokenmill.request",
    "tokenmill.sampling_params",
    "tokenmill.config",
]


def test_cache_and_core_import_without_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {PURE_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
