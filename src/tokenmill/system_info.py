"""What runs here: tokenmill and torch versions, the device, the CPU and its vector flags, the kernel variant
loaded and each fast path on or off with the reason. ``tokenmill info`` prints it, the server logs it at start
and exports it as ``tokenmill:build_info``, and the benchmark suite stores it with every figure."""

from __future__ import annotations

import json
import platform
from typing import Any


def collect() -> dict[str, Any]:
    """Everything above as a JSON-ready dict (imports torch and loads the kernels)."""
    import torch

    import tokenmill
    from tokenmill.model.cpu.kernels import kernel_summary

    info: dict[str, Any] = {
        "tokenmill": tokenmill.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "num_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    info.update(kernel_summary())
    return info


def one_line(info: dict[str, Any]) -> str:
    """The start-up log line: the CPU, the kernels and the paths that are off."""
    off = [
        name for name, state in info["fast_paths"].items() if state != "on" and not state.startswith("on ")
    ]
    return (
        f"CPU {info['cpu_model']} ({' '.join(info['cpu_isa_flags']) or 'no vector flags read'}); "
        f"kernels {info['kernel_variant']} ({info['kernel_reason']}); "
        f"fast paths off: {', '.join(off) if off else 'none'}"
    )


def render(info: dict[str, Any], as_json: bool = False) -> str:
    if as_json:
        return json.dumps(info, indent=2, sort_keys=True)
    lines = [
        f"tokenmill {info['tokenmill']}, torch {info['torch']}, Python {info['python']} on {info['machine']}",
        f"device: {info['device']}" + (f" ({info['cuda_device']})" if info["cuda_device"] else ""),
        f"cpu: {info['cpu_model']}, {info['num_threads']} threads",
        f"cpu vector flags: {' '.join(info['cpu_isa_flags']) or '(none read)'}",
        f"kernel variant: {info['kernel_variant']} ({info['kernel_reason']})",
        f"variants this CPU runs: {', '.join(info['runnable_variants'])}",
        f"kernel sources: {info['source_digest']}",
        "fast paths:",
        *(f"  {name:<18} {state}" for name, state in info["fast_paths"].items()),
    ]
    if "model" in info:
        lines.append(f"model: {info['model']['source']}: {info['model']['summary']}")
        if info["model"].get("arithmetic"):
            lines.append(info["model"]["arithmetic"])
        compute = info["model"].get("compute") or {}
        if compute:
            lines.append("compute: " + ", ".join(f"{key} {value}" for key, value in compute.items()))
        step, file_step = info["model"].get("decode_read_bytes"), info["model"].get("file_step_bytes")
        if step:
            line = f"a decode step reads {step / 1e6:.1f} MB of weights"
            if file_step:
                line += (
                    f"; the file's tensors other than the token embedding: {file_step / 1e6:.1f} MB "
                    f"({step / file_step:.3f}x)"
                )
            lines.append(line)
        breakdown = info["model"].get("weight_breakdown_bytes") or {}
        for kind, nbytes in sorted(breakdown.items(), key=lambda kv: -kv[1]):
            if kind != "mapped":
                lines.append(f"  {kind:40} {nbytes / 1e6:9.1f} MB")
        if "mapped" in breakdown:
            lines.append(
                f"  of which memory-mapped from the cache file (pages read once, shared): "
                f"{breakdown['mapped'] / 1e6:.1f} MB"
            )
    return "\n".join(lines)
