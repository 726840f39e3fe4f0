"""tokenmill itself in the suite: ``LLM.generate`` on the case's token-id prompts, and the overhead probe."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Runner, RunResult, missing_module, sync
from benchmarks.workloads import Workload

_WARMUP = Workload("warmup", "warm-up", [[300, 301, 302, 303], [400, 401]], [2, 2])


class TokenmillRunner(Runner):
    def __init__(
        self,
        device: str,
        dtype: str,
        num_threads: int | None,
        quantization: str | None = None,
        model: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.device, self.dtype, self.num_threads, self.model = device, dtype, num_threads, model
        self.quantization = quantization
        self.engine_kwargs = engine_kwargs
        self.name = "tokenmill" if quantization is None else f"tokenmill_{quantization}"
        # the weights' form (gguf blocks, fp32, int8) is known once loaded: the suite appends describe_weights()
        self.note = f"tokenmill LLM.generate, {dtype} activations"
        self.llm: Any = None

    def unavailable(self) -> str | None:
        return missing_module("tokenmill")

    def load(self) -> None:
        from tokenmill import LLM

        self.llm = LLM(
            self.model,
            device=self.device,
            dtype=self.dtype,
            num_threads=self.num_threads,
            quantization=self.quantization,
            **self.engine_kwargs,
        )
        self.run(_WARMUP)

    @property
    def vocab_size(self) -> int:
        return int(self.llm.engine.loaded.config.vocab_size)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.llm.engine.tokenizer.encode_chat(messages))

    def run(self, workload: Workload) -> RunResult:
        from tokenmill import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.max_tokens]
        stats = self.llm.engine.stats
        before = (stats.num_iterations, stats.num_preemptions)
        sync(self.device)
        t0 = time.perf_counter()
        outs = self.llm.generate(workload.prompts, params, use_tqdm=False)
        sync(self.device)
        elapsed = time.perf_counter() - t0
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        extra: dict[str, Any] = {
            "num_iterations": stats.num_iterations - before[0],
            "num_preemptions": stats.num_preemptions - before[1],
        }
        if workload.is_single_stream and outs[0].metrics is not None:
            m = outs[0].metrics
            if m.first_token_time_s is not None and m.last_token_time_s is not None:
                extra["ttft_s"] = m.first_token_time_s - m.arrival_time_s
                n = workload.max_tokens[0] - 1
                decode_s = m.last_token_time_s - m.first_token_time_s
                if n > 0 and decode_s > 0:
                    extra["decode_tokens_per_s"] = n / decode_s
        return RunResult(
            self.name,
            workload.case,
            time_s=elapsed,
            num_output_tokens=workload.num_output_tokens,
            output_token_ids=outputs,
            extra=extra,
        )

    def close(self) -> None:
        self.llm = None


def measure_overhead(
    llm: Any, device: str, batch_size: int = 64, prompt_len: int = 64, num_tokens: int = 32, seed: int = 0
) -> dict[str, float]:
    """Engine overhead at ``batch_size``: the share of decode-step time spent outside the model.

    ``batch_size`` requests decode together; the model's ``forward`` and ``compute_logits`` are timed
    inside each ``Engine.step()``. Only steps with exactly ``batch_size`` decode rows count.
    Everything else in the step (scheduling, building tensors, sampling, bookkeeping, detokenizing)
    is overhead.
    """
    from tokenmill import SamplingParams

    engine = llm.engine
    model = engine.runner.model
    vocab_size = int(engine.loaded.config.vocab_size)
    in_model_s = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            sync(device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(device)
            in_model_s[0] += time.perf_counter() - t0
            return out

        return wrapper

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    for _ in range(batch_size):
        engine.add_request([rng.randrange(256, vocab_size) for _ in range(prompt_len)], params)
    step_s = model_s = 0.0
    num_steps = 0
    model.forward = timed(model.forward)  # instance attributes shadow the class methods
    model.compute_logits = timed(model.compute_logits)
    try:
        while engine.has_unfinished():
            before = in_model_s[0]
            t0 = time.perf_counter()
            result = engine.step()
            sync(device)
            dt = time.perf_counter() - t0
            record = result.record
            if record.batch_size == batch_size and record.num_prefill_tokens == 0:
                step_s += dt
                model_s += in_model_s[0] - before
                num_steps += 1
    finally:
        del model.forward, model.compute_logits
    if not num_steps:
        return {"num_steps": 0}
    return {
        "batch_size": batch_size,
        "num_steps": num_steps,
        "step_ms": 1e3 * step_s / num_steps,
        "model_ms": 1e3 * model_s / num_steps,
        "overhead_fraction": 1.0 - model_s / step_s if model_s > 0 else float("nan"),
    }
