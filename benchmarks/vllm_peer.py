"""vLLM's CPU backend as a peer, run in its own virtualenv (``../shared/PEERS.md`` says how to make one).

Two halves:

- ``export_hf_dir(gguf)`` runs in tokenmill's environment: transformers reads the GGUF (dequantized to float32)
  and saves an HF directory vLLM can load (vLLM refuses ``quant_method: gguf`` on CPU, so the quantization config
  is dropped). Cached under ``~/.cache/tokenmill/peers/hf/<file stem>``; a second run reuses it.
- ``run_vllm(python, hf_dir, requests, dtype)`` starts this same file with vLLM's interpreter
  (``python vllm_peer.py < job.json``): it builds ``LLM(...)``, warms up untimed, times one ``generate`` of
  every request (token-id prompts, greedy, EOS ignored) and prints the elapsed time and token counts as JSON.

The half run by vLLM's interpreter imports only the standard library and vllm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CACHE_DIR = Path.home() / ".cache" / "tokenmill" / "peers" / "hf"
_DONE = ".tokenmill-export-done"


def export_hf_dir(gguf: str | Path, cache_dir: Path = CACHE_DIR) -> Path:
    """An HF directory (float32 safetensors, tokenizer, config without ``quantization_config``) of the GGUF."""
    gguf = Path(gguf)
    out = cache_dir / gguf.stem
    if (out / _DONE).exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # a GGUF-quantized model refuses save_pretrained: copy its weights into a plain one
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    saved["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2))
    (out / _DONE).write_text(str(gguf))
    return out


def best_dtype(cpu_flags: set[str]) -> str:
    """vLLM's best dtype on this CPU: bf16 where AVX-512 BF16 is (vdpbf16ps), float32 elsewhere."""
    return "bfloat16" if "avx512_bf16" in cpu_flags else "float32"


def _preloads(vllm_python: str) -> str:
    """tcmalloc and Intel OpenMP (vLLM's wheel brings libiomp5), as vLLM's CPU docs ask; those this machine has."""
    candidates = (
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        Path(vllm_python).parent.parent / "lib" / "libiomp5.so",
    )
    return ":".join(str(path) for path in candidates if path.exists())


# vLLM as an AVX2-only CPU runs it: its wheel picks its AVX2 kernel library when torch.cpu says the CPU has no
# AVX-512, and torch's, oneDNN's and MKL's own kernels take their caps from the environment (AVX2_ONLY_ENV). A
# sitecustomize on vLLM's path answers torch.cpu's two checks in every process vLLM starts.
AVX2_ONLY_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
_AVX2_ONLY_SITE = """import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def _avx2_only_site(directory: Path) -> Path:
    """A folder holding the sitecustomize that hides AVX-512 from vLLM's kernel choice."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_AVX2_ONLY_SITE)
    return directory


def run_vllm(
    vllm_python: str,
    hf_dir: Path,
    requests: list[tuple[list[int], int]],
    dtype: str,
    max_model_len: int = 2048,
    kv_cache_gib: int = 4,
    avx2_only: bool = False,
) -> dict[str, Any]:
    """Time vLLM on the requests in its own interpreter; returns {"elapsed_s", "num_output_tokens", "log_tail"}.
    ``avx2_only``: its kernels and torch's as on a CPU without AVX-512."""
    job = {"hf_dir": str(hf_dir), "dtype": dtype, "max_model_len": max_model_len, "requests": requests}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    preload = _preloads(vllm_python)
    if preload:
        env["LD_PRELOAD"] = preload
    env.pop("PYTHONPATH", None)  # vLLM's environment, not tokenmill's
    if avx2_only:
        env.update(AVX2_ONLY_ENV)
        env["PYTHONPATH"] = str(_avx2_only_site(CACHE_DIR.parent / "avx2-only-site"))
    proc = subprocess.run(
        [vllm_python, str(Path(__file__).resolve())],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        timeout=7200,
        check=False,
    )
    result_lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not result_lines:
        raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(result_lines[-1])
    result["log_tail"] = proc.stderr[-2000:]
    return result


def _serve_job() -> None:  # runs in vLLM's interpreter
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.load(sys.stdin)
    requests = job["requests"]
    llm = LLM(model=job["hf_dir"], dtype=job["dtype"], max_model_len=job["max_model_len"], max_num_seqs=256)
    warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    llm.generate([TokensPrompt(prompt_token_ids=requests[0][0][:32])], warm, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for _, m in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps({"elapsed_s": elapsed_s, "num_output_tokens": counts}), flush=True)


if __name__ == "__main__":
    _serve_job()
