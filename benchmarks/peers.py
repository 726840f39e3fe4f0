"""The peers, each on the same GGUF file and the same token-id prompts (``pip install tokenmill[peers]``).

- ``hf``: transformers ``generate`` on a static, left-padded batch (sdpa attention, fp32 on CPU and
  bf16 on CUDA, weights dequantized from the GGUF like tokenmill's). A static batch decodes until its
  longest request is done, so each batch of ``batch_size`` requests runs ``max(max_tokens)`` steps;
  only the tokens each request asked for count as useful.
- ``hf_cb``: transformers' own continuous batching (``init_continuous_batching``: a manager with a
  paged cache and a background thread), each request with its own ``max_new_tokens``.
- ``llamacpp``: llama.cpp through llama-cpp-python, one request after another (a single stream). It
  computes on the file's Q4_1 blocks with 8-bit activations, not on fp32 weights: it is what a user
  would pick instead, not like-for-like arithmetic.

Every peer runs greedy with EOS ignored, and loads and warms up outside the timed region.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Runner, RunResult, missing_module, sync
from benchmarks.workloads import Workload

_WARMUP = Workload("warmup", "warm-up", [[300, 301, 302, 303], [400, 401]], [2, 2])


_HF_MODELS: dict[tuple[Path, str, str], tuple[Any, Any]] = {}


def load_hf_model(gguf: Path, device: str, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer) from the GGUF file, offline; loaded once and shared by ``hf`` and ``hf_cb``."""
    key = (gguf, device, dtype)
    if key not in _HF_MODELS:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        )
        _HF_MODELS[key] = (model.to(device).eval(), tokenizer)
    return _HF_MODELS[key]


def release_hf_models() -> None:
    _HF_MODELS.clear()


class HFStaticRunner(Runner):
    name = "hf"
    note = "transformers generate, static left-padded batches"

    def __init__(self, gguf: Path, device: str, dtype: str, batch_size: int = 64) -> None:
        self.gguf, self.device, self.dtype, self.batch_size = gguf, device, dtype, batch_size
        self.model: Any = None
        self.pad_id = 0

    def unavailable(self) -> str | None:
        return missing_module("transformers")

    def load(self) -> None:
        self.model, tokenizer = load_hf_model(self.gguf, self.device, self.dtype)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id
        self.note = f"transformers generate, static left-padded batches of {self.batch_size}"
        self.run(_WARMUP)

    def run(self, workload: Workload) -> RunResult:
        import torch

        outputs: list[list[int]] = []
        num_steps = 0
        sync(self.device)
        t0 = time.perf_counter()
        for start in range(0, workload.num_requests, self.batch_size):
            prompts = workload.prompts[start : start + self.batch_size]
            wanted = workload.max_tokens[start : start + self.batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, width], left-padded
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            steps = max(wanted)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    max_new_tokens=steps,
                    min_new_tokens=steps,  # ignore EOS
                    do_sample=False,
                    pad_token_id=self.pad_id,
                )
            new = out[:, width:].tolist()  # [B, steps]
            outputs.extend(row[:n] for row, n in zip(new, wanted, strict=True))
            num_steps += steps
        sync(self.device)
        elapsed = time.perf_counter() - t0
        return RunResult(
            self.name,
            workload.case,
            time_s=elapsed,
            num_output_tokens=workload.num_output_tokens,
            output_token_ids=outputs,
            extra={"num_decode_steps": num_steps},
        )

    def close(self) -> None:
        self.model = None


class HFContinuousRunner(Runner):
    name = "hf_cb"
    note = "transformers continuous batching (init_continuous_batching)"

    def __init__(self, gguf: Path, device: str, dtype: str) -> None:
        self.gguf, self.device, self.dtype = gguf, device, dtype
        self.model: Any = None

    def unavailable(self) -> str | None:
        return missing_module("transformers")

    def load(self) -> None:
        self.model, _ = load_hf_model(self.gguf, self.device, self.dtype)
        self.run(_WARMUP)

    def run(self, workload: Workload) -> RunResult:
        import torch
        from transformers import GenerationConfig

        config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_tokens), eos_token_id=-1)
        results: dict[str, Any] = {}
        with torch.inference_mode(), self._manager(config, workload) as manager:
            # The manager is built and warmed up on entry; time from the first request to the last result.
            sync(self.device)
            t0 = time.perf_counter()
            ids = [
                manager.add_request(prompt, max_new_tokens=n)  # EOS off through the generation config
                for prompt, n in zip(workload.prompts, workload.max_tokens, strict=True)
            ]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    break
            sync(self.device)
            elapsed = time.perf_counter() - t0
        errors = [r.error for r in results.values() if r.error]
        if len(results) < len(ids) or errors:
            return RunResult(
                self.name,
                workload.case,
                status=f"error: {len(ids) - len(results)} unfinished, {len(errors)} failed",
            )
        outputs = [list(results[i].generated_tokens) for i in ids]
        return RunResult(
            self.name,
            workload.case,
            time_s=elapsed,
            num_output_tokens=workload.num_output_tokens,
            output_token_ids=outputs,
        )

    def _manager(self, config: Any, workload: Workload) -> Any:
        """The manager's context; workload hints (sizes for its cache) where this transformers takes them."""
        kwargs: dict[str, Any] = {"generation_config": config, "block": True, "timeout": 30}
        cm = self.model.continuous_batching_context_manager
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
        except ImportError:
            WorkloadHints = None  # noqa: N806
        if WorkloadHints is not None and "workload_hints" in inspect.signature(cm).parameters:
            kwargs["workload_hints"] = WorkloadHints(
                max_prompt_length=max(workload.prompt_lens),
                max_generated_length=max(workload.max_tokens),
                num_requests=workload.num_requests,
            )
        return cm(**kwargs)

    def close(self) -> None:
        if self.model is not None:
            self.model.destroy_cached_continuous_batching_manager()
        self.model = None


class LlamaCppRunner(Runner):
    name = "llamacpp"
    note = (
        "llama.cpp (llama-cpp-python) on the Q4_1 file, one request at a time: not like-for-like arithmetic"
    )

    def __init__(self, gguf: Path, device: str, num_threads: int, n_ctx: int = 2048) -> None:
        self.gguf, self.device, self.num_threads, self.n_ctx = gguf, device, num_threads, n_ctx
        self.llm: Any = None

    def unavailable(self) -> str | None:
        return missing_module("llama_cpp")

    def load(self) -> None:
        import llama_cpp

        n_gpu_layers = 0
        if self.device.startswith("cuda"):
            if not llama_cpp.llama_supports_gpu_offload():
                self.note = "llama.cpp CPU build (no GPU offload), one request at a time"
            else:
                n_gpu_layers = -1
        self.llm = llama_cpp.Llama(
            model_path=str(self.gguf),
            n_ctx=self.n_ctx,
            n_batch=512,
            n_threads=self.num_threads,
            n_threads_batch=self.num_threads,
            n_gpu_layers=n_gpu_layers,
            seed=0,
            verbose=False,
        )
        self.run(_WARMUP)

    def _generate(self, prompt: list[int], num_tokens: int) -> tuple[list[int], float]:
        """The tokens and the time to the first one."""
        self.llm.reset()  # no prefix reuse from the previous request
        tokens: list[int] = []
        t0 = time.perf_counter()
        ttft_s = 0.0
        # generate() consumes the list it is given: pass a copy. It yields EOS like any token: EOS is ignored.
        for token in self.llm.generate(
            list(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0
        ):
            if not tokens:
                ttft_s = time.perf_counter() - t0
            tokens.append(int(token))
            if len(tokens) == num_tokens:
                break
        return tokens, ttft_s

    def supports(self, workload: Workload) -> str | None:
        longest = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens, strict=True))
        return None if longest <= self.n_ctx else f"skipped: needs a context of {longest}"

    def run(self, workload: Workload) -> RunResult:
        outputs, ttfts = [], []
        t0 = time.perf_counter()
        for prompt, n in zip(workload.prompts, workload.max_tokens, strict=True):
            tokens, ttft_s = self._generate(prompt, n)
            outputs.append(tokens)
            ttfts.append(ttft_s)
        elapsed = time.perf_counter() - t0
        extra: dict[str, Any] = {}
        if workload.is_single_stream:
            extra["ttft_s"] = ttfts[0]
            if workload.max_tokens[0] > 1:
                extra["decode_tokens_per_s"] = (workload.max_tokens[0] - 1) / (elapsed - ttfts[0])
        return RunResult(
            self.name,
            workload.case,
            time_s=elapsed,
            num_output_tokens=workload.num_output_tokens,
            output_token_ids=outputs,
            extra=extra,
        )

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
        self.llm = None
