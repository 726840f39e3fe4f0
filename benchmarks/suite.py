"""The benchmark suite: every case through tokenmill and its peers, against the hardware's limits.

    python benchmarks/suite.py [--cases a,b,c,d,e] [--peers hf,hf_cb,llamacpp] [--json out.json] [--quick]
    python benchmarks/suite.py --model qwen2.5-coder-1.5b-instruct --peers llamacpp   # a pulled model

1. Load tokenmill (fp32 on CPU, bf16 on CUDA) and build the cases' token-id prompts (``workloads.py``).
2. Measure the hardware limits (``tokenmill/model/hardware.py``): matmul FLOP/s at the model's shapes, read bandwidth.
3. Run each engine over the chosen cases, one engine at a time, loading and warming it up untimed.
4. Put a lower bound on each (case, engine) from the FLOP/byte model (``tokenmill/measure/cost_model.py``) with that
   engine's bytes per weight, and print time, useful tokens/s, time over tokenmill's, the fraction of
   the limit reached and the share of outputs identical to tokenmill's; then the targets, PASS/FAIL.
5. Write everything as JSON (default ``bench_out/suite-<time>.json``; ``bench_out/`` is git-ignored).

A peer that is not installed (``pip install tokenmill[peers]``) shows as "not installed".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# transformers' GGUF loader draws a progress bar; tqdm reads this when it is first imported.
os.environ.setdefault("TQDM_DISABLE", "1")

from benchmarks import report, workloads  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Runner,
    RunResult,
    default_dtype,
    embedded_gguf_path,
    pick_device,
)
from benchmarks.peers import HFContinuousRunner, HFStaticRunner, LlamaCppRunner, release_hf_models  # noqa: E402
from benchmarks.tokenmill_runner import TokenmillRunner, measure_overhead  # noqa: E402
from tokenmill import system_info  # noqa: E402
from tokenmill.measure.cost_model import SMOLLM2_135M, ModelShape, workload_bound  # noqa: E402
from tokenmill.model import hardware  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
ALL_PEERS = ("hf", "hf_cb", "llamacpp")
_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases", default=",".join(workloads.ALL_CASES), help="comma-separated, from a,b,c,d,e"
    )
    parser.add_argument(
        "--peers", default=",".join(ALL_PEERS), help="comma-separated from hf,hf_cb,llamacpp; or none"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="output file (default bench_out/suite-<time>.json)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke-test sizes: seconds per engine, not minutes"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads for every engine (torch default)"
    )
    parser.add_argument(
        "--int8-cases", default="c", help="cases also run with quantization='int8'; '' for none"
    )
    parser.add_argument(
        "--fp32-cases",
        default="b,c",
        help="cases also run with quantization='fp32' (the GGUF dequantized at load, beside the default that "
        "computes from its blocks); '' for none",
    )
    parser.add_argument(
        "--exact-cases",
        default="b,c,d",
        help="cases also run with quantization='gguf' (the exact path: fp32 activations times the blocks' exact "
        "values, beside the default, llama.cpp's arithmetic where model/arithmetic.py chooses it); '' for none",
    )
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf peer")
    parser.add_argument("--no-overhead", action="store_true", help="skip the engine-overhead probe")
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="run tokenmill with prefix caching off (on by default, as in the engine)",
    )
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file for the peers (default: embedded)")
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="a model `tokenmill pull` fetched (or a GGUF path): every engine runs that file, the limits come "
        "from its shapes and bytes (same as --gguf PATH)",
    )
    args = parser.parse_args(argv)
    if args.model is not None:
        from tokenmill.model.registry import resolve

        if args.gguf is not None:
            parser.error("give --model or --gguf, not both")
        try:
            args.gguf = Path(resolve(args.model))
        except ValueError as exc:  # a catalogue name not pulled yet
            parser.error(str(exc))
        if not args.gguf.is_file():
            parser.error(f"--model {args.model}: no such file {args.gguf} (tokenmill pull {args.model})")
    args.case_list = _split(args.cases, workloads.ALL_CASES, "--cases")
    args.peer_list = [] if args.peers == "none" else _split(args.peers, ALL_PEERS, "--peers")
    args.int8_case_list = (
        _split(args.int8_cases, workloads.ALL_CASES, "--int8-cases") if args.int8_cases else []
    )
    args.fp32_case_list = (
        _split(args.fp32_cases, workloads.ALL_CASES, "--fp32-cases") if args.fp32_cases else []
    )
    args.exact_case_list = (
        _split(args.exact_cases, workloads.ALL_CASES, "--exact-cases") if args.exact_cases else []
    )
    return args


def _split(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _quiet_peers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        if args.threads:
            torch.set_num_threads(args.threads)
        self.num_threads = torch.get_num_threads()
        self.device = pick_device(args.device)
        self.dtype = args.dtype or default_dtype(self.device)
        self.gguf = args.gguf or embedded_gguf_path()
        self.shape = SMOLLM2_135M
        self.results: list[RunResult] = []
        self.load_s: dict[str, float] = {}
        self.overhead: dict[str, float] | None = None
        self.cases: dict[str, workloads.Workload] = {}
        self.plan: list[tuple[Runner, list[str]]] = []
        self.limits: hardware.HardwareLimits | None = None

    # --- the engines -------------------------------------------------------------------------------
    def runners(self) -> list[tuple[Runner, list[str]]]:
        """(runner, its cases) in the order they run."""
        wb = _DTYPE_BYTES[self.dtype]
        out: list[tuple[Runner, list[str]]] = []
        model = str(self.args.gguf) if self.args.gguf else None  # None: tokenmill's embedded model
        caching = {"enable_prefix_caching": getattr(self.args, "enable_prefix_caching", True)}
        tm = TokenmillRunner(self.device, self.dtype, self.num_threads, model=model, **caching)
        out.append((self._with_bytes(tm, wb, wb), self.args.case_list))
        exact_cases = [c for c in self.args.case_list if c in self.args.exact_case_list]
        if exact_cases and self.device == "cpu":  # the GGUF blocks' kernels are CPU-only
            exact = TokenmillRunner(
                self.device, self.dtype, self.num_threads, quantization="gguf", model=model, **caching
            )
            exact.note = (
                f"tokenmill LLM.generate, the exact path ({self.dtype} activations, the blocks' values)"
            )
            out.append((self._with_bytes(exact, wb, wb), exact_cases))
        fp32_cases = [c for c in self.args.case_list if c in self.args.fp32_case_list]
        if fp32_cases:
            f = TokenmillRunner(
                self.device, self.dtype, self.num_threads, quantization="fp32", model=model, **caching
            )
            out.append((self._with_bytes(f, wb, wb), fp32_cases))
        int8_cases = [c for c in self.args.case_list if c in self.args.int8_case_list]
        if int8_cases:
            q = TokenmillRunner(
                self.device, self.dtype, self.num_threads, quantization="int8", model=model, **caching
            )
            out.append((self._with_bytes(q, 1.0, wb), int8_cases))
        if "hf" in self.args.peer_list:
            hf = HFStaticRunner(self.gguf, self.device, self.dtype, self.args.hf_batch_size)
            out.append((self._with_bytes(hf, wb, wb), self.args.case_list))
        if "hf_cb" in self.args.peer_list:
            out.append(
                (
                    self._with_bytes(HFContinuousRunner(self.gguf, self.device, self.dtype), wb, wb),
                    self.args.case_list,
                )
            )
        if "llamacpp" in self.args.peer_list:
            # llama.cpp's KV cache is f16; its bytes per weight are the file's, set once the shape is known.
            lc = LlamaCppRunner(self.gguf, self.device, self.num_threads)
            out.append((self._with_bytes(lc, 0.0, 2.0), self.args.case_list))
        return out

    @staticmethod
    def _with_bytes(runner: Runner, weight_bytes: float, kv_bytes: float) -> Runner:
        runner.weight_bytes = weight_bytes
        runner.kv_bytes = kv_bytes
        return runner

    def _build_cases(self, source: Any) -> None:
        """Prompts from tokenmill's tokenizer, or the peers' when tokenmill could not load."""
        vocab_size, chat = self.shape.vocab_size, None
        if isinstance(source, TokenmillRunner) and source.llm is not None:
            self.shape = ModelShape.from_config(source.llm.engine.loaded.config)
            vocab_size = source.vocab_size
            chat = source.encode_chat(workloads.CHAT_MESSAGES)
        else:
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(self.gguf.parent), gguf_file=self.gguf.name)
                chat = list(
                    tok.apply_chat_template(
                        workloads.CHAT_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
                    )
                )
            except Exception as exc:  # no tokenizer at all: case (c) gets a fixed id prompt
                _log(f"no tokenizer for the chat prompt ({exc}); case (c) uses 24 fixed ids")
                chat = list(range(1000, 1024))
        for case in self.args.case_list:
            self.cases[case] = workloads.build(case, vocab_size, chat, quick=self.args.quick)
            _log(f"case {self.cases[case].describe()}")

    # --- running -----------------------------------------------------------------------------------
    def run(self, json_path: Path) -> dict[str, Any]:
        """Every engine in turn; the JSON is rewritten after each, so a run cut short keeps what it measured."""
        self.plan = self.runners()
        for runner, cases in self.plan:
            self._run_engine(runner, cases)
            if self.limits is None:  # once, after the first engine has fixed the model's shape
                self.limits = self._measure_hardware()
            self._apply_bounds(self.limits)
            _write_json(json_path, self._summary(self.limits))
        release_hf_models()
        assert self.limits is not None
        return self._summary(self.limits)

    def _run_engine(self, runner: Runner, cases: list[str]) -> None:
        reason = runner.unavailable()
        if reason is None:
            _log(f"[{runner.name}] loading ...")
            t0 = time.perf_counter()
            try:
                runner.load()
            except Exception as exc:
                reason = f"error: load failed: {type(exc).__name__}: {exc}"
            self.load_s[runner.name] = time.perf_counter() - t0
        if not self.cases:
            self._build_cases(runner)
        if isinstance(runner, TokenmillRunner) and runner.llm is not None:
            loaded = runner.llm.engine.loaded
            if loaded.quantization in ("gguf", "gguf-q8"):  # the bytes it reads: the blocks as kept in memory
                runner.weight_bytes = loaded.weight_bytes / (
                    self.shape.matmul_params + self.shape.lm_head_params
                )
            # integer dot products: "% limit" against the integer peak, the limit of that arithmetic
            runner.integer_arithmetic = loaded.quantization in ("gguf-q8", "gguf-q4")
            runner.note += f"; {loaded.describe_weights()}; {loaded.describe_arithmetic()}"
        if isinstance(runner, LlamaCppRunner):
            # It reads the file's blocks as stored (Q4_1 and the rest): bytes per weight of the file.
            runner.weight_bytes = self.gguf.stat().st_size / (
                self.shape.matmul_params + self.shape.lm_head_params
            )
        for case in cases:
            workload = self.cases[case]
            reason_case = reason or runner.supports(workload)
            if reason_case is not None:
                self.results.append(RunResult(runner.name, case, status=reason_case))
                _log(f"[{runner.name}] ({case}) {reason_case}")
                continue
            try:
                result = runner.run(workload)
            except Exception as exc:
                result = RunResult(runner.name, case, status=f"error: {type(exc).__name__}: {exc}")
            if result.ok and result.output_token_ids is not None:
                wrong = sum(
                    len(o) != n for o, n in zip(result.output_token_ids, workload.max_tokens, strict=True)
                )
                if wrong:  # EOS not ignored, or a request cut short: the time is not comparable
                    result.status = f"error: {wrong} requests got the wrong number of tokens"
            result.extra["weight_bytes"] = runner.weight_bytes
            result.extra["kv_bytes"] = runner.kv_bytes
            result.extra["integer_arithmetic"] = runner.integer_arithmetic
            self.results.append(result)
            _log(
                f"[{runner.name}] ({case}) {result.status}"
                + (f" {result.time_s:.2f} s" if result.time_s is not None else "")
            )
        if reason is None and isinstance(runner, TokenmillRunner) and runner.quantization is None:
            self._probe_overhead(runner)
        runner.close()

    def _probe_overhead(self, runner: TokenmillRunner) -> None:
        if self.args.no_overhead or runner.llm is None:
            return
        try:
            num_tokens = 8 if self.args.quick else 32
            self.overhead = measure_overhead(
                runner.llm, self.device, batch_size=64, prompt_len=16, num_tokens=num_tokens
            )
            _log(f"[{runner.name}] overhead probe: {self.overhead}")
        except Exception as exc:
            _log(f"[{runner.name}] overhead probe failed: {type(exc).__name__}: {exc}")

    def _measure_hardware(self) -> hardware.HardwareLimits:
        import torch

        _log("measuring hardware limits ...")
        limits = hardware.measure_model(
            self.shape, self.device, getattr(torch, self.dtype), quick=self.args.quick
        )
        _log(limits.describe())
        return limits

    def _apply_bounds(self, limits: hardware.HardwareLimits) -> None:
        for r in self.results:
            wb, kvb = r.extra.get("weight_bytes"), r.extra.get("kv_bytes")
            if wb is None or kvb is None:
                continue
            w = self.cases[r.case]
            # llama.cpp's arithmetic: projections and head on the integer peak, attention (fp32) on the fp32 one
            peak, attention_peak = limits.peak_flops, None
            if r.extra.get("integer_arithmetic") and limits.peak_int_ops:
                peak, attention_peak = limits.peak_int_ops, limits.peak_flops
            bound = workload_bound(
                self.shape, w.prompt_lens, w.max_tokens, peak, limits.peak_read_bw, wb, kvb, attention_peak
            )
            r.extra["limit_s"] = bound.time_s
            r.extra["limited_by"] = bound.limited_by

    # --- output ------------------------------------------------------------------------------------
    def _summary(self, limits: hardware.HardwareLimits) -> dict[str, Any]:
        wb = _DTYPE_BYTES[self.dtype]
        cases = {}
        for case, w in self.cases.items():
            bound = workload_bound(
                self.shape, w.prompt_lens, w.max_tokens, limits.peak_flops, limits.peak_read_bw, wb, wb
            )
            cases[case] = {
                "title": w.title,
                "num_requests": w.num_requests,
                "num_prompt_tokens": w.num_prompt_tokens,
                "num_output_tokens": w.num_output_tokens,
                f"bound_{self.dtype}": bound.as_dict(),
            }
        agree = report.agreement(self.results)
        checks = report.check_targets(self.results, self.overhead)
        return {
            "meta": {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "quick": self.args.quick,
                "device": self.device,
                "dtype": self.dtype,
                "num_threads": self.num_threads,
                "machine": platform.processor() or platform.machine(),
                "python": platform.python_version(),
                "versions": {
                    d: _version(d) for d in ("tokenmill", "torch", "transformers", "llama_cpp_python")
                },
                "gguf": str(self.gguf),
                "load_s": self.load_s,
                # the CPU model and flags, the kernel variant and each fast path: what produced these figures
                "system": system_info.collect(),
            },
            "hardware": limits.as_dict(),
            "cases": cases,
            "results": [
                {
                    "case": r.case,
                    "engine": r.engine,
                    "status": r.status,
                    "time_s": r.time_s,
                    "num_output_tokens": r.num_output_tokens,
                    "tokens_per_s": r.num_output_tokens / r.time_s if r.time_s else None,
                    "fraction_of_limit": report.fraction_of_limit(r),
                    "agreement_with_tokenmill": agree.get((r.case, r.engine)),
                    **r.extra,
                }
                for r in self.results
            ],
            "overhead": self.overhead,
            "targets": [c.as_dict() for c in checks],
        }

    def print_report(self, summary: dict[str, Any]) -> None:
        assert self.limits is not None
        print("machine:", system_info.one_line(summary["meta"]["system"]))
        print(self.limits.describe())
        print()
        for case, info in summary["cases"].items():
            b = info[f"bound_{self.dtype}"]
            print(
                f"({case}) {info['title']}: {info['num_requests']} requests, {info['num_prompt_tokens']} prompt + "
                f"{info['num_output_tokens']} output tokens; {self.dtype} limit {b['time_s']:.2f} s "
                f"(compute {b['compute_s']:.2f} s, memory {b['memory_s']:.2f} s, {b['num_forwards']} forwards)"
            )
        print()
        print(report.table(self.results, report.agreement(self.results)))
        print()
        for runner, _ in self.plan:
            print(f"  {runner.name}: {runner.note}")
        print(
            "  x tm = time / tokenmill's time; % limit = lower bound / time (with that engine's bytes per weight);"
            " agree = outputs identical to tokenmill's"
        )
        for r in self.results:
            if r.ok and "decode_tokens_per_s" in r.extra:
                print(
                    f"  ({r.case}) {r.engine}: time to first token {1e3 * r.extra['ttft_s']:.0f} ms, then "
                    f"{r.extra['decode_tokens_per_s']:.1f} tokens/s"
                )
        if self.overhead and self.overhead.get("num_steps"):
            o = self.overhead
            print(
                f"  engine overhead at batch {o['batch_size']:.0f}: {100 * o['overhead_fraction']:.1f}% of a "
                f"{o['step_ms']:.1f} ms decode step ({o['model_ms']:.1f} ms in the model)"
            )
        print()
        print("targets" + (" (--quick sizes: not meaningful)" if self.args.quick else "") + ":")
        for c in report.check_targets(self.results, self.overhead):
            print(c.line())


def _write_json(path: Path, summary: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _quiet_peers()
    suite = Suite(args)
    _log(
        f"device {suite.device}, dtype {suite.dtype}, {suite.num_threads} threads, cases {args.cases}, "
        f"peers {args.peers}{', quick' if args.quick else ''}"
    )
    path = args.json or REPO_ROOT / "bench_out" / f"suite-{time.strftime('%Y%m%d-%H%M%S')}.json"
    summary = suite.run(path)
    suite.print_report(summary)
    print(f"\nwrote {path}")
    return summary


if __name__ == "__main__":
    main()
