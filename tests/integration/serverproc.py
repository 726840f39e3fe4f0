"""A real ``tokenmill serve`` process on a free loopback port, for the server's integration tests."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

SMALL_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "256", "--log-level", "warning", "--no-access-log")
_SAMPLE = re.compile(r"^(\S+?)(\{.*\})? (\S+)$")


def _model_name_first(labels: str | None) -> str:
    """``{k="v",...}`` with model_name first, the others in their order (prometheus_client sorts them)."""
    if not labels:
        return ""
    pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels)
    pairs.sort(key=lambda kv: kv[0] != "model_name")
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, module: str = "tokenmill.server.launch"
    ) -> None:
        self.module = module  # run as `python -m module`; faulty_launch injects step failures
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # the prefix cache's disk tier (on by default) in a folder of this server's: blocks that an earlier
        # server (or test run) computed must not turn up as cached tokens here
        self.kv_dir = tempfile.mkdtemp(prefix="tokenmill-kv-")
        own_tier = any(a in ("--kv-cache-disk-dir", "--no-kv-cache-disk") for a in args)
        self.args = [*SMALL_ARGS, *(() if own_tier else ("--kv-cache-disk-dir", self.kv_dir)), *args]
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(prefix="tokenmill-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        return self.launch().wait_healthy(timeout_s)

    def launch(self) -> ServerProcess:
        """Start the process and return at once (the model loads meanwhile)."""
        cmd = [sys.executable, "-m", self.module, "--port", str(self.port), *self.args]
        here = os.path.dirname(os.path.abspath(__file__))
        env = {
            **self.env,
            "PYTHONPATH": os.pathsep.join([here, self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_healthy(self, timeout_s: float = 180.0) -> ServerProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """``{'name{labels}': value}`` from /metrics (labels as printed)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5.0).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line:
                continue
            m = _SAMPLE.match(line)
            assert m, line
            out[m.group(1) + _model_name_first(m.group(2))] = float(m.group(3).replace("+Inf", "inf"))
        return out

    def metric(self, name: str) -> float:
        """The value of a metric whose only label is model_name."""
        values = [v for k, v in self.metrics().items() if k == name or k.startswith(name + "{model_name=")]
        assert len(values) == 1, (name, values)
        return values[0]

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.kv_dir, ignore_errors=True)
        return self.proc.returncode


EMBEDDED_MODEL = "SmolLM2-135M-Instruct"


def model_server(pulled: str | None, *args: str) -> ServerProcess:
    """A started server on the embedded model (``pulled`` None) or on a model ``tokenmill pull`` fetches (pulled
    once, then cached), with ``model_name`` set to what clients call it."""
    if pulled is not None:
        from tokenmill.model import registry as models

        args = (*args, "--model", str(models.pull(pulled, progress=False, log=lambda s: None)))
    proc = ServerProcess(*args).start(timeout_s=600)
    proc.model_name = pulled or EMBEDDED_MODEL  # type: ignore[attr-defined]
    return proc
