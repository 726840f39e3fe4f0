"""The vLLM peer's AVX2-only mode: what vLLM's interpreter is started with (a stand-in interpreter reports it)."""

import stat
import sys

from benchmarks import vllm_peer

_REPORT = """
import json, os, sys
import torch.cpu
sys.stdin.read()
print(json.dumps({"elapsed_s": 0.0, "num_output_tokens": [], "avx512": torch.cpu._is_avx512_supported(),
                  "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
                  "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                         "MKL_ENABLE_INSTRUCTIONS", "VLLM_CPU_KVCACHE_SPACE")}}))
"""


def _stand_in(tmp_path):
    """An executable that runs this interpreter on the report above, whatever file it is given."""
    script = tmp_path / "report.py"
    script.write_text(_REPORT)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return str(python)


def test_avx2_only_hides_avx512_from_every_process_and_caps_the_libraries(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "CACHE_DIR", tmp_path / "cache" / "hf")
    for name in vllm_peer.AVX2_ONLY_ENV:
        monkeypatch.delenv(name, raising=False)
    python = _stand_in(tmp_path)
    capped = vllm_peer.run_vllm(python, tmp_path, [], "float32", avx2_only=True)
    assert capped["avx512"] is False and capped["avx512_bf16"] is False
    assert capped["env"] == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    plain = vllm_peer.run_vllm(python, tmp_path, [], "float32")
    assert plain["env"]["ATEN_CPU_CAPABILITY"] is None and plain["env"]["MKL_ENABLE_INSTRUCTIONS"] is None
    import torch.cpu

    assert plain["avx512"] == torch.cpu._is_avx512_supported()  # the CPU's own answer
