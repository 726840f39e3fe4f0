"""glibc's thresholds (``model/cpu/allocator.py``): a step-sized activation comes from the heap, whose freed blocks
the next step reuses, where by default it is a mapping of its own, zeroed page by page on first touch and given
back when freed (``/proc/self/maps`` is the reference: where the kernel says the block lies)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

PRELUDES = {  # what runs before the two steps
    "default": "",
    "keep": "from tokenmill.model.cpu.allocator import keep_step_memory\nassert keep_step_memory()",
    "engine": "from tokenmill.engine import Engine\nEngine(num_kv_blocks=8)",
}
SCRIPT = """
import torch
{prelude}
def region(address):
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        start, end = (int(a, 16) for a in span.split("-"))
        if start <= address < end:
            return rest[-1] if len(rest) == 5 else "anonymous"
for _ in range(2):  # a prefill's activation, 64 MiB: past glibc's largest default mmap threshold (32 MiB)
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    where = region(x.data_ptr())
    del x
print(where)
"""


def region(mode: str) -> str:
    """The mapping that held the second step's activation after ``PRELUDES[mode]``: ``[heap]`` or ``anonymous``
    (a mapping of its own)."""
    script = SCRIPT.format(prelude=PRELUDES[mode])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return out.stdout.split()[-1]


def test_a_step_sized_activation_comes_from_the_heap() -> None:
    assert region("default") == "anonymous"
    assert region("keep") == "[heap]"


def test_an_engine_on_the_cpu_sets_them() -> None:
    assert region("engine") == "[heap]"
